"""Launch parameters of the NSA kernels on CUDA, and the switches that choose between kernels.

`TUNING` is a Python object, not part of the run config: change it in-process (`nsa bench attention --sweep`
varies it around the defaults). The kernels read it at each launch. Under the CPU interpreter every kernel uses
its smallest tiles: there the cost is per program and per operation, not per FLOP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tuning:
    # ---------------------------------------------------------------- span kernels (Triton)
    span_block_m: int = 128
    """(token, head) rows per program of the compressed/window/tiled-selected forward and dQ kernels at head dims up
    to 64."""
    span_block_m_wide: int = 64
    """The same above head dim 64: 128 rows need more registers than a program has there."""
    span_block_n: int = 64
    """Keys per inner step of those kernels."""
    span_warps: int = 4
    span_stages: int = 2
    dkdv_block_m: int = 128
    """(token, head) rows per inner step of the span dK/dV kernel, head dims up to 64."""
    dkdv_block_m_wide: int = 64
    """The same above head dim 64."""
    dkdv_block_n: int = 64
    """Keys per program of the dK/dV kernel."""
    dkdv_warps: int = 4
    dkdv_stages: int = 2
    cmp_rows_per_split: int = 8192
    """Most (token, head) rows per program of the compressed/selected dK/dV kernel (32 under the CPU interpreter):
    a compressed key is seen by most later queries, so its rows are split over several programs."""
    dkdv_programs_per_sm: int = 4
    """Rows are split further until that kernel has this many programs per SM (short sequences)."""

    # ---------------------------------------------------------------- dQ of every branch (Triton)
    dq_block_m: int = 64
    """(token, head) rows per program of the dQ kernel, head dims up to 64 (above, span_block_m_wide): 128 rows
    spill."""
    dq_block_n: int = 64
    """Keys per inner step of the dQ kernel."""
    dq_block_n_tiled: int = 32
    """The same while the selected branch runs tiled (short sequences), head dims up to 64: its masked tiles make
    the smaller step the faster one there."""
    dq_warps: int = 4

    # ---------------------------------------------------------------- Gluon kernels (sm_90)
    gluon_forward: bool = True
    """On an sm_90 GPU, run the span forward as the Gluon kernel (nsa.ops.gluon.forward) where it applies; False
    keeps Triton's kernel, the one the CPU tests check."""
    gluon_backward: bool = True
    """The same for the span dK/dV kernel (nsa.ops.gluon.backward)."""
    gluon_query_grad: bool = True
    """The same for the dQ kernel of every branch (nsa.ops.gluon.query_grad)."""
    gluon_selected_forward: bool = True
    """The same for the block-centric selected branch's per-block partials (nsa.ops.gluon.selected_forward)."""
    gluon_selected_backward: bool = True
    """The same for the block-centric selected branch's dK/dV and dQ shares (nsa.ops.gluon.selected_backward; its
    tiles: gluon_dkdv_*)."""
    gluon_packed: bool = True
    """Also run packed documents (a PackedLayout) on the Gluon kernels above (all but the tiled selected branch,
    which stays on Triton's). Off, the Triton kernels serve packed calls; tests/ops/test_triton_gpu.py checks the
    Gluon ones against them and against the reference on a Hopper GPU."""
    gluon_span_min_elements: int = 1 << 23
    """The Gluon span forward, dK/dV and dQ kernels serve from this many elements of q (B * T * H * Dk) on. Below,
    an eager call is bound by host time, where a Gluon launch costs 150-300 us against Triton's 50-100: M7C at
    batch 1 and up to 8k tokens takes the Triton kernels. Not decided by whether a CUDA graph is being captured:
    the kernels a capture records must be the ones its warm-up compiled and loaded."""
    gluon_selected_forward_min_elements: int = 1 << 24
    """The Gluon block-centric forward serves from this many elements of q (B * T * H * Dk) on: below, a call is
    bound by host time, and a Gluon launch (it builds TMA descriptors) costs more of it than a Triton one."""
    gluon_selected_backward_min_elements: int = 1 << 24
    """The same for the Gluon block-centric backward."""
    gluon_block_m: int = 64
    """(token, head) rows per program of the Gluon span forward at head dims up to 64 (a warp per 16 rows)."""
    gluon_stages: int = 3
    """Key/value tiles in flight in its shared-memory ring."""
    gluon_dkdv_block_m: int = 64
    """(token, head) rows per step of the Gluon dK/dV kernels at head dims up to 64."""
    gluon_dkdv_block_n: int = 64
    """Keys per program of those kernels at head dims up to 64 (a warp per 16 keys); the block-centric one needs it
    equal to the selection block."""
    gluon_dkdv_stages: int = 3
    """Row steps in flight in their shared-memory ring (cp.async)."""
    gluon_selected_forward_stages: int = 3
    """Row steps in flight in the Gluon block-centric forward's shared-memory ring."""
    gluon_dq_block_m: int = 64
    """(token, head) rows per program of the Gluon dQ kernel at head dims up to 64 (a warp per 16 rows)."""
    gluon_dq_stages: int = 3
    """Key/value steps in flight in its shared-memory ring."""

    # ---------------------------------------------------------------- selected branch: paths
    tiled_max_blocks: int = 32
    """The selected branch runs tiled (dense causal tiles masked by the choices, like the window branch) while a
    sequence has at most this many selection blocks (64 at most), gathered beyond: while most of a query's prefix
    is chosen, dense tiles waste little and run at flash-attention efficiency."""
    tiled_max_blocks_large_groups: int = 64
    """The same where the gathered path would be per-query (h >= token_min_heads)."""
    tiled_max_blocks_forward: int = 64
    """The selected forward runs tiled up to this many blocks (64 at most) even where the backward goes
    block-centric: both compute the same o_sel and lse, and the tiled forward stays the faster one longer than the
    tiled backward does. 0 follows the backward."""
    token_min_heads: int = 16
    """Group sizes from here on compute the selected forward and dQ per query (each gathered key block then feeds
    h >= 16 matrix rows); smaller groups go block-centric."""

    # ---------------------------------------------------------------- selected branch: gathered kernels
    token_warps: int = 4
    """Warps of the per-query selected-branch kernels."""
    sel_block_r: int = 64
    """(query, head) rows per inner step of the block-centric selected-branch kernels, head dims up to 64."""
    sel_warps: int = 4
    sel_block_r_wide: int = 128
    """The same above head dim 64, on sel_warps_wide warps."""
    sel_warps_wide: int = 8
    row_block_m: int = 64
    """(token, head) rows per program of the selected branch's merge-and-gated-sum and dQ-reduction kernels."""
    row_warps: int = 4
    inverse_chunk: int = 256
    """(query, slot) entries per work item of the block-centric selected-branch kernels (4 under the interpreter)."""
    inverse_query_ranges: int = 4
    """The inverse index splits a sequence's queries into this many ranges and orders its work items by range, then
    block, so that the programs running together gather their rows from one range of q (and do), which stays in
    the L2 cache; not in deterministic mode, whose sums need a block's items together."""
    inverse_min_range: int = 2048
    """...each range holding at least this many tokens (16 under the interpreter): shorter ranges leave the items
    of a range and block less full."""

    # ---------------------------------------------------------------- selection, gates, phi
    select_block_t: int = 16
    """Tokens per program of the selection kernel."""
    select_warps: int = 4
    select_transposed_max_rows: int = 128
    """The selection kernel computes its scores transposed while a tile has at most this many (token, head) rows
    (select_block_t x heads per group, padded to a power of two); larger tiles transposed would compute their
    product twice on 8 warps."""
    gate_block_m: int = 32
    """(token, head) rows per program of the gate-gradient kernel (gating.py)."""
    gate_warps: int = 4
    phi_block_m: int = 64
    """Blocks per program of phi's kernels (compression.py; chunks of block_stride tokens in the token gradient's,
    rows per step in fc1's weight gradient's)."""
    phi_warps: int = 4
    phi_w1_rows: int = 1024
    """Fewest blocks per program of fc1's weight-gradient kernel (it splits the blocks until every SM has two)."""

    # ---------------------------------------------------------------- streams
    branch_streams: bool = True
    """On CUDA, queue the compressed branch (forward with the block choice, and its dK/dV) and the window's dK/dV
    on a second stream, beside the window and selected kernels (nsa.ops.streams); False keeps one stream."""
    branch_streams_min_elements: int = 1 << 24
    """...from this many elements of q (B * T * H * Dk) on: the fork and join cost host time, which shows where a
    call's host time exceeds its GPU time. While a CUDA graph is captured every size forks (no host time at
    replay)."""

    # ---------------------------------------------------------------- decode
    decode_chunk_programs_per_sm: int = 1
    """The decode kernel's compressed pass gives each program 2, 4 or 8 chunks of compressed tokens (a pipelined
    loop) while at least this many programs per SM remain: large batches fill the GPU with fewer, longer programs;
    batch 1 keeps one chunk a program."""
    decode_chunk_stages: int = 3
    """Chunks in flight in that loop."""
    dense_decode_split: int = 512
    """Cached tokens per program of the dense decode kernel (nsa.ops.triton.dense_decode; a multiple of 64). At
    64k tokens, 128 splits per (sequence, key/value group): enough programs to fill the GPU at batch 1, and a
    merge of few partials."""


TUNING = Tuning()
