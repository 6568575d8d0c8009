"""The public NSA ops: validate arguments, then run the chosen backend.

`backend="auto"` picks the fastest correct implementation for the inputs' device;
today that is the pure-PyTorch reference everywhere. `backend="reference"`
forces the oracle (for debugging a fast path).
"""

from __future__ import annotations

import torch

from . import reference
from .validation import check_nsa_inputs, check_select_inputs

BACKENDS = ("auto", "reference")


def _resolve(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown NSA backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return "reference"


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block: int,
    n_sel: int,
    window: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Native Sparse Attention output [B,T,H,Dv] (DESIGN.md section 1).

    q [B,T,H,Dk]; k_cmp/v_cmp [B,Nc,G,D] (already compressed); k_sel, v_sel, k_win,
    v_win [B,T,G,D]; gates [B,T,H,3] in (cmp, sel, win) order, already in [0, 1].
    Differentiable in every tensor argument.
    """
    check_nsa_inputs(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates,
        block_len=block_len, block_stride=block_stride, sel_block=sel_block, n_sel=n_sel, window=window,
    )
    _resolve(backend, q.device)
    return reference.nsa_attention(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates,
        block_len=block_len, block_stride=block_stride, sel_block=sel_block, n_sel=n_sel, window=window,
        scale=scale,
    )


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block: int,
    n_sel: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Selected block indices [B,T,G,n] (int64, ascending, unused slots -1)."""
    check_select_inputs(q, k_cmp, block_len=block_len, block_stride=block_stride, sel_block=sel_block, n_sel=n_sel)
    _resolve(backend, q.device)
    return reference.select_blocks(
        q, k_cmp, block_len=block_len, block_stride=block_stride, sel_block=sel_block, n_sel=n_sel, scale=scale
    )
