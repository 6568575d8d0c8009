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
    """Keys per inner step of the compressed/window kernels (halved for head dims above 64)."""
    range_warps: int = 4
    range_stages: int = 2
    select_block_t: int = 16
    """Tokens per program of the selection kernel."""
    select_warps: int = 4
    sel_warps: int = 4
    """Warps of the per-token selected-branch forward and dQ kernels."""
    sel_stages: int = 2
    dkdv_block_r: int = 64
    """(query, head) rows per inner step of the selected-branch dK/dV kernel."""
    dkdv_warps: int = 4
    inverse_chunk: int = 256
    """Queries per dK/dV work item of the selected branch."""


TUNING = Tuning()
