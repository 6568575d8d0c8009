"""The block-centric selected branch's calls replayed as standalone CUDA graphs, checked against eager calls.

item_order.py's first form (thirtieth session) failed with an illegal memory access when it replayed these calls
as CUDA graphs at 65,536 tokens. This script isolates one call per process, so that a failure names it:

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/graph_replay_check.py --case 32768x2 --range 0'

--range 0 is the unsplit index (one query range, as deterministic mode builds it); --part picks the call:
`forward` (selected forward and merge), `kernel` (the partials kernel alone) or `backward` (selected backward and
dQ). It prints the largest difference from the eager call after the replays, or dies with the CUDA error.

What the thirty-first session found on an H100 (benchmarks/RESULTS.md): this script's cases all pass (unsplit and
ranges; forward, partials kernel, backward at 32k x 2). The same calls captured by the session's first script
(`history/2026-11-27-h100-s31-graph-replay/graph_check.py`, item_order.py's first form cut down) fail on their first
replay with an illegal memory access whenever the index is unsplit: the forward (Gluon or Triton kernels), the
partials kernel alone, with the partial buffers allocated before the capture, at 32k x 1, 32k x 2, 16k x 4 and 8k x
8; its backward fails with "operation not supported on global/shared address space". With ranges of 8,192 tokens it
passes, and under compute-sanitizer (memcheck, initcheck) it passes with 0 errors. The two scripts differ in the
order of their allocations and eager calls (and this one zero-fills the kernel's buffers), so the failure follows
the memory layout; the cause is unknown. Training with deterministic mode (an unsplit index) and CUDA graphs ran (8k
x 8).
"""

from __future__ import annotations

import argparse

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.ops import select_blocks
from nsa.ops.triton import query_grad as qg
from nsa.ops.triton import range_attention as ra
from nsa.ops.triton import selected_attention as sa
from nsa.ops.triton.hopper_selected_forward import selected_forward_hopper
from nsa.ops.triton.inverse_index import inverse_index
from nsa.ops.triton.tuning import TUNING


def capture(fn):
    """(graph, its outputs) of fn, warmed up on a side stream first; the outputs stay alive with the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="32768x2", help="TOKENSxBATCH")
    p.add_argument("--range", type=int, default=0, help="query-range length in tokens; 0: unsplit")
    p.add_argument("--part", choices=("forward", "kernel", "backward"), default="forward")
    p.add_argument("--triton", action="store_true", help="the Triton kernels instead of the Gluon ones")
    p.add_argument("--replays", type=int, default=5)
    ns = p.parse_args()
    if ns.triton:
        TUNING.hopper_selected_forward = TUNING.hopper_selected_backward = False
    T, batch = (int(x) for x in ns.case.split("x"))
    H, G, Dk, Dv = SHAPES["m7c"]
    sb, n = HP["sel_block"], HP["n_sel"]
    hp = (HP["block_len"], HP["block_stride"], HP["window"])
    q, k_cmp, v_cmp, k, v, k_win, v_win, gates = (x.detach() for x in make_inputs(T, H, G, Dk, Dv, batch=batch))
    scale = Dk**-0.5
    idx = select_blocks(q, k_cmp, **{x: HP[x] for x in ("block_len", "block_stride", "sel_block", "n_sel")})
    inv = inverse_index(idx, -(-T // sb), TUNING.inverse_chunk, ns.range or T)
    o_cmp, o_win, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)

    def forward():
        return sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb)[0]

    def kernel():
        parts = torch.zeros(batch * G * T * n, H // G, Dv, device=q.device, dtype=q.dtype)
        lse = torch.zeros(batch * G * T * n, H // G, device=q.device, dtype=torch.float32)
        selected_forward_hopper(q, k, v, parts, lse, inv, scale, n)
        return parts

    _, o_sel, lse = sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb)
    others = [ra.range_attention_fwd(q, kk, vv, mode, scale, *hp)
              for mode, kk, vv in ((ra.MODE_CMP, k_cmp, v_cmp), (ra.MODE_WIN, k_win, v_win))]
    delta = (do.float() * o_sel.float()).sum(-1)
    lse_g = torch.stack([others[0][1], lse, others[1][1]])
    delta_g = torch.stack([(do.float() * x.float()).sum(-1) for x in (others[0][0], o_sel, others[1][0])])

    def backward():
        dk, dv, sel = sa.selected_backward(q, k, v, idx, inv, do, lse, delta, scale, sb)
        return torch.cat([dk.flatten().float(), dv.flatten().float(),
                          qg.query_grad(q, do, lse_g, delta_g, scale, *hp, (k_cmp, v_cmp), (k_win, v_win),
                                        sel).flatten().float()])

    fn = {"forward": forward, "kernel": kernel, "backward": backward}[ns.part]
    want = fn()
    graph, got = capture(fn)
    torch.cuda.synchronize()
    print(f"{ns.case} range {ns.range or 'unsplit'} {ns.part}: captured", flush=True)
    for i in range(ns.replays):
        graph.replay()
        torch.cuda.synchronize()
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    print(f"{ns.case} range {ns.range or 'unsplit'} {ns.part}: {ns.replays} replays ok, max diff / max {err:.1e}")


if __name__ == "__main__":
    main()
