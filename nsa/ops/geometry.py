"""Block geometry shared by every NSA backend (DESIGN.md section 1).

Compressed block i covers tokens [i*d, i*d + l); selection block j covers
[j*l', (j+1)*l'). These helpers are the single source of those formulas.
"""

from __future__ import annotations

import torch


def num_compressed_blocks(seq_len: int, block_len: int, block_stride: int) -> int:
    """Nc = floor((T - l) / d) + 1, or 0 when T < l."""
    if seq_len < block_len:
        return 0
    return (seq_len - block_len) // block_stride + 1


def num_selection_blocks(seq_len: int, sel_block: int) -> int:
    """Number of selection blocks that hold at least one of the T tokens."""
    return -(-seq_len // sel_block)


def check_hyperparameters(
    block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int | None = None
) -> None:
    """Raise ValueError naming the broken rule of DESIGN.md section 1."""
    for name, value in (("block_len", block_len), ("block_stride", block_stride), ("sel_block", sel_block)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if block_len % block_stride or sel_block % block_stride:
        raise ValueError(
            f"block_stride ({block_stride}) must divide block_len ({block_len}) and sel_block ({sel_block})"
        )
    if n_sel < 3:
        raise ValueError(f"n_sel must be >= 3 to leave room for the forced blocks, got {n_sel}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def compressed_block_ends(num_blocks: int, block_len: int, block_stride: int, device=None) -> torch.Tensor:
    """Last token position covered by each compressed block: i*d + l - 1."""
    return torch.arange(num_blocks, device=device) * block_stride + block_len - 1


def overlap_matrix(
    num_cmp: int, num_sel: int, block_len: int, block_stride: int, sel_block: int, dtype=torch.float32, device=None
) -> torch.Tensor:
    """M[i, j] = |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, the Eq. 9 weights (shape [Nc, Ns])."""
    starts = torch.arange(num_cmp, device=device) * block_stride
    sel_starts = torch.arange(num_sel, device=device) * sel_block
    lo = torch.maximum(starts[:, None], sel_starts[None, :])
    hi = torch.minimum(starts[:, None] + block_len, sel_starts[None, :] + sel_block)
    return (hi - lo).clamp_min(0).to(dtype) / block_stride
