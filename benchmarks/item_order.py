"""The block-centric selected branch's work order and its dQ (Tuning.inverse_query_ranges, selected_dq_adds).

Its kernels gather each item's query rows (and, in the backward, the output gradients) from anywhere in the sequence:
at 32k the gathered q alone is 1.6 GB a layer's forward, from a q of 100 MB that does not fit the L2 cache. The
inverse index splits every block's queries into ranges and orders the items by range, so that the programs that run
together gather from one range. For the index unsplit and split into ranges of each given length, on one selection,
this script times (GPU time, calls queued back to back) the Gluon forward with its merge, and the backward with the
dQ kernel, the rows' dQ written as per-slot shares or added into one float32 dQ; and checks that the results agree.

This script's first form timed CUDA-graph replays, and they failed with an illegal memory access at 65,536 tokens:
it kept only each graph, so the inverse index a graph read was freed when the loop moved to the next variant
(benchmarks/RESULTS.md, thirty-first session). Calls queued without graphs show the same ratios.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/item_order.py --cases 32768x2 --ranges 8192,4096'
"""

from __future__ import annotations

import argparse
import statistics

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import time_cuda
from nsa.ops import select_blocks
from nsa.ops.triton import query_grad as qg
from nsa.ops.triton import range_attention as ra
from nsa.ops.triton import selected_attention as sa
from nsa.ops.triton.inverse_index import inverse_index
from nsa.ops.triton.tuning import TUNING


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="32768x2")
    p.add_argument("--ranges", default="8192,4096", help="query-range lengths in tokens (unsplit is always timed)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk", type=int, default=TUNING.inverse_chunk, help="(query, slot) entries per work item")
    ns = p.parse_args()
    TUNING.inverse_chunk = ns.chunk
    H, G, Dk, Dv = SHAPES["m7c"]
    sb = HP["sel_block"]
    hp = (HP["block_len"], HP["block_stride"], HP["window"])
    for case in ns.cases.split(","):
        T, batch = (int(x) for x in case.split("x"))
        q, k_cmp, v_cmp, k, v, k_win, v_win, gates = (x.detach() for x in make_inputs(T, H, G, Dk, Dv, batch=batch))
        scale = Dk**-0.5
        idx = select_blocks(q, k_cmp, **{x: HP[x] for x in ("block_len", "block_stride", "sel_block", "n_sel")})
        o_cmp, o_win, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
        # query_grad's other branches: the compressed and window lse from their forward.
        others = [ra.range_attention_fwd(q, kk, vv, mode, scale, *hp)
                  for mode, kk, vv in ((ra.MODE_CMP, k_cmp, v_cmp), (ra.MODE_WIN, k_win, v_win))]
        variants = {"unsplit": T, **{f"ranges {r}": int(r) for r in ns.ranges.split(",")}}
        runs, ref = {}, None
        for name, qrange in variants.items():
            inv = inverse_index(idx, -(-T // sb), TUNING.inverse_chunk, qrange)
            o, o_sel, lse = sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb)
            delta = (do.float() * o_sel.float()).sum(-1)
            lse_g = torch.stack([others[0][1], lse, others[1][1]])
            delta_g = torch.stack([(do.float() * x.float()).sum(-1) for x in (others[0][0], o_sel, others[1][0])])

            def backward(inv=inv, lse=lse, delta=delta, lse_g=lse_g, delta_g=delta_g):
                dk, dv, sel = sa.selected_backward(q, k, v, idx, inv, do, lse, delta, scale, sb)
                return dk, dv, sel, qg.query_grad(q, do, lse_g, delta_g, scale, *hp, (k_cmp, v_cmp), (k_win, v_win),
                                                  sel)

            fns = [lambda inv=inv: sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb)]
            for adds in (False, True):
                TUNING.selected_dq_adds = adds
                dk, dv, sel, dq = backward()
                got = (o, dk, dv, sel.dense(), dq)
                if ref is None:
                    ref = got
                else:
                    err = [(a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                           for a, b in zip(got, ref)]
                    print(f"{case} {name}, dQ {'adds' if adds else 'shares'}: max diff / max against unsplit shares: "
                          "o {:.1e}, dK {:.1e}, dV {:.1e}, selected dQ {:.1e}, dQ {:.1e}".format(*err), flush=True)
                fns.append(lambda backward=backward, adds=adds: (setattr(TUNING, "selected_dq_adds", adds),
                                                                 backward()))
            runs[name] = fns
        TUNING.selected_dq_adds = True
        labels = ("forward+merge", "backward+dQ, shares", "backward+dQ, adds")
        times = {name: tuple([] for _ in labels) for name in runs}
        for _ in range(ns.rounds):
            for name, fns in runs.items():
                for i, fn in enumerate(fns):
                    times[name][i].append(time_cuda(fn, queued=True))
        base = [statistics.median(x) for x in times["unsplit"]]
        for name, ts in times.items():
            cells = [f"{lab} {statistics.median(x):.3f} ms ({b / statistics.median(x):.3f}x)"
                     for lab, x, b in zip(labels, ts, base)]
            print(f"{case} {name:>13}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
