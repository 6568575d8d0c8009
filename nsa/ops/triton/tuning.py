"""Launch parameters of the NSA kernels on CUDA (the benchmark's --sweep varies them in-process).

Under the CPU interpreter every kernel uses its smallest tiles: there the cost is per
program and per operation, not per FLOP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tuning:
    range_block_m: int = 64
    """(token, head) rows per program of the compressed/window kernels."""
    range_block_n: int = 64
    """Keys per inner step of the compressed/window kernels (measured on H200, bf16, 2k x 16: 64 beats 32 by
    1.4x at head dim 128 and by 1.1x at 64)."""
    range_warps: int = 4
    range_stages: int = 2
    cmp_rows_per_split: int = 8192
    """Most (token, head) rows per program of the compressed/selected dK/dV kernel (32 under the CPU interpreter)."""
    dkdv_programs_per_sm: int = 4
    """Rows are split further until that kernel has this many programs per SM (short sequences)."""
    tiled_max_blocks: int = 64
    """The selected branch runs tiled (dense causal tiles that skip unchosen blocks, like the window branch)
    while a sequence has at most this many selection blocks, block-centric beyond."""
    select_block_t: int = 16
    """Tokens per program of the selection kernel."""
    select_warps: int = 4
    token_min_heads: int = 16
    """Group sizes from here on compute the selected forward and dQ per query (each gathered key block
    then feeds h >= 16 matrix rows); smaller groups go block-centric (measured: DESIGN shapes, H200)."""
    token_warps: int = 4
    """Warps of the per-query selected-branch kernels."""
    sel_block_r: int = 64
    """(query, head) rows per inner step of the block-centric selected-branch kernels."""
    sel_warps: int = 4
    inverse_chunk: int = 256
    """(query, slot) entries per work item of the block-centric selected-branch kernels (4 under the interpreter)."""


TUNING = Tuning()
