"""Launch parameters of the NSA kernels on CUDA (the benchmark's --sweep varies them in-process).

Under the CPU interpreter every kernel uses its smallest tiles: there the cost is per
program and per operation, not per FLOP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tuning:
    range_block_m: int = 128
    """(token, head) rows per program of the compressed/window/tiled-selected forward and dQ kernels at head
    dims up to 64 (measured on H200 at 2k x 16 for all three kernels together: 128 rows are 1.1x faster at
    D=64 than 64, 1.7x slower at D=128)."""
    range_block_m_wide: int = 64
    """The same above head dim 64."""
    range_block_n: int = 64
    """Keys per inner step of those kernels (measured as above: 64 beats 32 by 1.4x at D=128, 1.1x at D=64)."""
    range_warps: int = 4
    range_stages: int = 2
    hopper_forward: bool = True
    """On an sm_90 GPU, run the compressed/window/tiled-selected forward as the Gluon kernel of hopper_forward.py
    (TMA, asynchronous wgmma) where it applies; False keeps Triton's kernel (the one the CPU tests check)."""
    hopper_block_m: int = 64
    """(token, head) rows per program of that kernel at head dims up to 64 (a warp per 16 rows)."""
    hopper_stages: int = 3
    """Key/value tiles in flight in its shared-memory ring. Measured on H100, dense causal M7C forward (w = T):
    339 / 379 TFLOP/s at 2k x 16 / 64k with 3 stages, 344 / 396 with 4, Triton's kernel 282 / 380; on NSA's own
    branches 3 stages won more often."""
    hopper_backward: bool = True
    """On an sm_90 GPU, run the compressed/window/tiled-selected dK/dV kernel as the Gluon kernel of
    hopper_backward.py where it applies; False keeps Triton's kernel (the one the CPU tests check)."""
    hopper_dkdv_block_m: int = 64
    """(token, head) rows per step of that kernel at head dims up to 64."""
    hopper_dkdv_block_n: int = 64
    """Keys per program of that kernel at head dims up to 64 (a warp per 16 keys)."""
    hopper_dkdv_stages: int = 3
    """Row steps in flight in its shared-memory ring (cp.async). GPU time on an H100, M7C at 2k x 16, 64 rows x
    64 keys: 3 stages 0.655 ms on the tiled selected branch, 2 stages 0.689, Triton 0.785; 32 rows or 128 keys were
    slower (the kernel alone, graphed)."""
    hopper_selected_backward: bool = True
    """On an sm_90 GPU, run the block-centric selected branch's dK/dV (and dQ shares) as the Gluon kernel of
    hopper_selected_backward.py where it applies (its tiles: hopper_dkdv_*); False keeps Triton's kernel (the one
    the CPU tests check)."""
    hopper_selected_backward_min_elements: int = 1 << 24
    """...from this many elements of q (B * T * H * Dk) on: below, a call is bound by the host, and a Gluon launch
    costs more of it than Triton's (H100, M7C at 16k x 1, 12.6M elements, one run per call: 3.99 ms with it
    against 3.48 without, where two identical settings differed by 0.3 ms, though its GPU time is 0.45 ms against
    0.53; at 4k x 16, 50M elements, GPU time 1.53 ms against 1.78)."""
    hopper_selected_forward: bool = True
    """On an sm_90 GPU, run the block-centric selected branch's per-block partials as the Gluon kernel of
    hopper_selected_forward.py where it applies; False keeps Triton's kernel (the one the CPU tests check)."""
    hopper_selected_forward_min_elements: int = 1 << 24
    """...from this many elements of q on (the host-time reason of hopper_selected_backward_min_elements)."""
    hopper_selected_forward_stages: int = 3
    """Row steps in flight in that kernel's shared-memory ring."""
    hopper_query_grad: bool = True
    """On an sm_90 GPU, run query_grad's dQ kernel as the Gluon kernel of hopper_query_grad.py where it applies;
    False keeps Triton's kernel (the one the CPU tests check)."""
    hopper_dq_block_m: int = 64
    """(token, head) rows per program of that kernel at head dims up to 64 (a warp per 16 rows)."""
    hopper_dq_stages: int = 3
    """Key/value steps in flight in its shared-memory ring. GPU time on an H100, M7C (the kernel
    alone, graphed): 3 stages 0.505 / 1.43 ms at 2k x 16 / 64k, 2 stages 0.500 / 1.56, 4 stages 0.566 / 1.61;
    128 rows 0.682 / 1.88."""
    dq_block_m: int = 64
    """(token, head) rows per program of query_grad's dQ kernel (all branches), head dims up to 64
    (range_block_m_wide above). Measured on H100, M7C: 64 rows 0.72 / 2.49 ms at 2k x 16 / 64k, 128 rows 0.92 /
    3.53 (which spill 384 B, compiled for sm_90)."""
    dq_block_n: int = 64
    """Keys per inner step of the dQ kernel."""
    dq_block_n_tiled: int = 32
    """The same while the selected branch runs tiled (short sequences), head dims up to 64 (measured on H100, M7C
    at 2k x 16: 32 keys 0.64 ms, 64 keys 0.72; at 64k, block-centric, 64 keys win: 2.49 ms against 3.06)."""
    dq_warps: int = 4
    dkdv_block_m: int = 128
    """(token, head) rows per inner step of their dK/dV kernel, head dims up to 64."""
    dkdv_block_m_wide: int = 64
    """The same above head dim 64."""
    dkdv_block_n: int = 64
    """Keys per program of the dK/dV kernel."""
    dkdv_warps: int = 4
    dkdv_stages: int = 2
    cmp_rows_per_split: int = 8192
    """Most (token, head) rows per program of the compressed/selected dK/dV kernel (32 under the CPU interpreter)."""
    dkdv_programs_per_sm: int = 4
    """Rows are split further until that kernel has this many programs per SM (short sequences)."""
    tiled_max_blocks: int = 32
    """The selected branch runs tiled (dense causal tiles masked by the choices, like the window branch) while a
    sequence has at most this many selection blocks (64 at most), gathered beyond (measured on H200, M7C, 16
    sequences: tiled 1.15x faster at 2k, 1.2x slower at 4k)."""
    tiled_max_blocks_large_groups: int = 64
    """The same where the gathered path would be per-query (h >= token_min_heads; measured on H200, paper shape,
    16 sequences at 4k: tiled 1.08x faster)."""
    tiled_max_blocks_forward: int = 64
    """The selected forward runs tiled up to this many blocks (64 at most) even where the backward goes
    block-centric: the tiled forward is faster there, its backward is not (measured on H100, M7C at 4k x 16, GPU
    time: forward 2.10 ms tiled against 2.91 block-centric; dK/dV + dQ 3.85 against 2.63). 0 follows the backward."""
    select_block_t: int = 16
    """Tokens per program of the selection kernel."""
    select_warps: int = 4
    select_transposed_max_rows: int = 128
    """The selection kernel computes its scores transposed while a tile has at most this many (token, head) rows
    (select_block_t x heads per group, padded to a power of two). M7C, 128 rows: 2.87 ms untransposed, 2.44
    transposed at 64k on an H100 (one call; the kernel as shipped read 2.50); the paper shape's 256 rows on 8
    warps took 11.3 -> 19.4 ms transposed."""
    token_min_heads: int = 16
    """Group sizes from here on compute the selected forward and dQ per query (each gathered key block
    then feeds h >= 16 matrix rows); smaller groups go block-centric (measured: DESIGN shapes, H200)."""
    token_min_heads_forward: int = 16
    """The same for the selected forward where its Gluon block-centric kernel serves (hopper_selected_forward.py;
    the backward's dQ follows token_min_heads). Above token_min_heads it trades memory for speed: at the paper
    shape (16 heads a group, H100, GPU time of the selected forward with its merge) block-centric took 8.62 ms
    against 10.06 per query at 8k x 4 and 19.4 against 20.2 at 64k, but its per-block partials take B*T*n*H*Dv
    bf16 while the forward runs: 17 GB at 64k, 69 GB for two sequences of 128k (too much for an 80 GB H100)."""
    token_warps: int = 4
    """Warps of the per-query selected-branch kernels."""
    sel_block_r: int = 64
    """(query, head) rows per inner step of the block-centric selected-branch kernels, head dims up to 64."""
    sel_warps: int = 4
    sel_block_r_wide: int = 128
    """The same above head dim 64 (measured on H100, paper shape at 64k: the selected backward 70.1 ms at 64 rows
    on 4 warps, 49.7 at 128 rows on 8)."""
    sel_warps_wide: int = 8
    row_block_m: int = 64
    """(token, head) rows per program of the selected branch's merge-and-gated-sum and dQ-reduction kernels."""
    row_warps: int = 4
    gate_block_m: int = 32
    """(token, head) rows per program of the gate-gradient kernel (gating.py)."""
    gate_warps: int = 4
    phi_block_m: int = 64
    """Blocks per program of phi's kernels (compression.py; chunks of block_stride tokens in the token gradient's,
    rows per step in fc1's weight gradient's). H100, M7C 2k x 32, one key set: forward
    0.030 ms at 64 blocks on 4 warps, 0.038-0.096 at 32 or 128 blocks on 4 or 8 warps."""
    phi_warps: int = 4
    phi_w1_rows: int = 1024
    """Fewest blocks per program of fc1's weight-gradient kernel (it splits the blocks until every SM has two).
    Measured as above: forward+backward 0.1295 ms at 1,024, 0.1352-0.1361 at 512 and 2,048."""
    branch_streams: bool = True
    """On CUDA, queue the compressed branch (forward with the block choice, and its dK/dV) on a second stream,
    beside the window and selected kernels (streams.py)."""
    branch_streams_min_elements: int = 1 << 24
    """...from this many elements of q (B * T * H * Dk) on: the fork and join cost host time, which shows where a
    call's host time exceeds its GPU time. Alternating A/B on an H100 (benchmarks/ab.py), M7C forward+backward
    queued back to back, with the side stream: 1.04x at 8k x 16 (two runs), 0.99-1.03x at 2k x 32 and 2k x 64; a run
    where the host set the pace (2k x 32 and 8k x 4) read 0.905x and 0.963x. While a CUDA graph is captured every
    size forks (no host time at replay): M7C 2k x 1 0.268 -> 0.225 ms of GPU time (twenty-fifth session)."""
    window_grads_beside: bool = True
    """With branch_streams, the window branch's dK/dV goes to that stream too, beside the selected branch's
    backward and dQ."""
    decode_chunk_programs_per_sm: int = 1
    """The decode kernel's compressed pass gives each program 2, 4 or 8 chunks of compressed tokens (a pipelined
    loop) while at least this many programs per SM remain. H100, M7C, batch 16:
    the pass took 22.1 us at 64k with one chunk a program (2,048 programs), 20.2 with 4, 18.6 with 8 (256
    programs); at 128k 40.5 with one, 37.9 with 8. Batch 1 keeps one (8 chunks: 3.2 -> 13 us)."""
    decode_chunk_stages: int = 3
    """Chunks in flight in that loop (H100, 128k x 16, 8 chunks a program: 3 stages 34.6 us, 2 38.4, 1 45.3)."""
    inverse_chunk: int = 256
    """(query, slot) entries per work item of the block-centric selected-branch kernels (4 under the interpreter)."""
    inverse_query_ranges: int = 4
    """The inverse index splits a sequence's queries into this many ranges and orders its work items by range, then
    block, so that the programs running together gather their rows from one range of q (and do), which stays in
    the L2 cache; not in deterministic mode, whose sums need a block's items together. H100, M7C at 32k x 2, GPU
    time: selected forward with its merge 1.788 -> 1.697 ms with ranges of 8,192 tokens,
    1.707 with 4,096, 1.857 with 1,024 (items of a range and block fill less)."""
    inverse_min_range: int = 2048
    """...each range holding at least this many tokens (16 under the interpreter). H100, M7C at 8k x 8: forward
    with merge / backward 1.03x / 1.06x faster with ranges of 2,048 tokens, 1.00x / 1.04x with 8,192."""
    selected_dq_adds: bool = True
    """The block-centric selected backward's Gluon kernel adds each row's dQ into one float32 dQ of the branch with
    relaxed atomics (in the L2 cache, the rows of one query range at a time), instead of writing a bf16 share per
    (query, slot, head) that the dQ kernel reads back: at M7C 32k x 2, 1.61 GB written and read a layer (now a 0.2
    GB float32 dQ). H100, 32k x 2, selected backward and dQ kernel (two runs): 3.347 /
    3.200 ms with shares, 3.199 / 3.157 with adds and ranges of 8,192 tokens (3.314 / 3.233 with shares and those
    ranges); a graph replay of a whole layer's forward and backward ties (8.572 ms with adds, 8.555 with shares).
    Kept for the memory and the float32 sum. Not in deterministic mode."""


TUNING = Tuning()
