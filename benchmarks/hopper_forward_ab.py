"""The Gluon range forward (nsa/ops/triton/hopper_forward.py) against the Triton kernel, branch by branch, GPU time
per call (queued), the two alternating over several rounds on the same inputs; medians and their ratio.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/hopper_forward_ab.py [--cases m7c:2048x16,...]'
"""

from __future__ import annotations

import argparse
import statistics

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import format_table, time_cuda
from nsa.ops import select_blocks
from nsa.ops.triton import range_attention as ra
from nsa.ops.triton.tuning import TUNING

MODES = {"compressed": ra.MODE_CMP, "window": ra.MODE_WIN, "selected+gated": ra.MODE_SEL}


def calls(shape: str, T: int, batch: int) -> dict:
    """Branch name -> a call of range_attention_fwd on random M7C/paper inputs (tiled selected only while it fits)."""
    H, G, Dk, Dv = SHAPES[shape]
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = (t.detach() for t in make_inputs(T, H, G, Dk, Dv,
                                                                                            batch=batch))
    scale = Dk**-0.5
    out = {
        "compressed": lambda: ra.range_attention_fwd(q, k_cmp, v_cmp, ra.MODE_CMP, scale, 32, 16, HP["window"]),
        "window": lambda: ra.range_attention_fwd(q, k_win, v_win, ra.MODE_WIN, scale, 32, 16, HP["window"]),
    }
    blocks = -(-T // HP["sel_block"])
    if blocks <= 64:
        idx = select_blocks(q, k_cmp, **{k: HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")})
        bits = ra.chosen_bits(idx, blocks)
        gated = (torch.randn_like(q), torch.randn_like(q), gates)
        out["selected+gated"] = lambda: ra.range_attention_fwd(q, k_sel, v_sel, ra.MODE_SEL, scale, 32, 16,
                                                               HP["window"], bits, HP["sel_block"], gated)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="m7c:2048x16,m7c:8192x4,m7c:16384x2,m7c:65536x1,paper:2048x16,"
                                      "paper:8192x4,paper:65536x1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--configs", default="64:4,64:2,128:3,128:2", help="rows:stages of the Gluon kernel also timed")
    ns = p.parse_args()
    rows = []
    for case in ns.cases.split(","):
        shape, size = case.split(":")
        T, batch = (int(x) for x in size.split("x"))
        for branch, fn in calls(shape, T, batch).items():
            times = {True: [], False: []}
            TUNING.hopper_min_tokens_window = TUNING.hopper_min_tokens_compressed = 0  # Gluon serves every branch
            for _ in range(ns.rounds):
                for gluon in (True, False):
                    TUNING.hopper_forward = gluon
                    times[gluon].append(time_cuda(fn, queued=True))
            TUNING.hopper_forward = True
            gl_ms, tr_ms = statistics.median(times[True]), statistics.median(times[False])
            row = {"shape": shape, "T": T, "batch": batch, "branch": branch, "gluon_ms": gl_ms,
                   "triton_ms": tr_ms, "triton/gluon": tr_ms / gl_ms}
            for config in filter(None, ns.configs.split(",")):  # other tiles and stage counts, Gluon only
                block_m, stages = (int(x) for x in config.split(":"))
                base = (TUNING.hopper_block_m, TUNING.hopper_stages)
                TUNING.hopper_block_m, TUNING.hopper_stages = block_m, stages
                row[f"gluon {config}"] = statistics.median(time_cuda(fn, queued=True) for _ in range(3))
                TUNING.hopper_block_m, TUNING.hopper_stages = base
            rows.append(row)
            print(rows[-1], flush=True)
    print(format_table(rows, list(dict.fromkeys(k for r in rows for k in r))))


if __name__ == "__main__":
    main()
