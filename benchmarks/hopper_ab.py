"""The Gluon range kernels (nsa/ops/triton/hopper_forward.py, hopper_backward.py) against the Triton ones, branch by
branch, GPU time per call (queued), the two alternating over several rounds on the same inputs; medians and their
ratio. --kernel fwd times the forward, dkdv the dK/dV kernel, dq the dQ kernel (all branches in one call), selbwd the
selected backward beyond the tiled lengths (hopper_selected_backward.py; its tiles are dkdv's), selfwd the
block-centric selected forward with its merge (hopper_selected_forward.py; M7C beyond 64 blocks, e.g.
--cases m7c:8192x4,m7c:65536x1). --graphs times
CUDA-graph replays: the GPU's time alone, without the host's launches (a Gluon launch builds its TMA descriptors on
the host, which dominates calls of ~0.1 ms when they are timed back to back).

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/hopper_ab.py --kernel dkdv [--cases m7c:2048x16,...]'
"""

from __future__ import annotations

import argparse
import statistics

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import format_table, graphed, time_cuda
from nsa.ops import select_blocks
from nsa.ops.triton import query_grad as qg
from nsa.ops.triton import range_attention as ra
from nsa.ops.triton.tuning import TUNING

MODES = {"compressed": ra.MODE_CMP, "window": ra.MODE_WIN, "selected+gated": ra.MODE_SEL}


def calls(shape: str, T: int, batch: int, kernel: str) -> dict:
    """Branch name -> a call of range_attention_fwd or _dkdv on random M7C/paper inputs (tiled selected only while
    it fits)."""
    H, G, Dk, Dv = SHAPES[shape]
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = (t.detach() for t in make_inputs(T, H, G, Dk, Dv,
                                                                                            batch=batch))
    scale = Dk**-0.5
    branches = {"compressed": (ra.MODE_CMP, k_cmp, v_cmp, None, 0), "window": (ra.MODE_WIN, k_win, v_win, None, 0)}
    blocks = -(-T // HP["sel_block"])
    idx = select_blocks(q, k_cmp, **{k: HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")})
    if blocks <= 64:
        branches["selected+gated"] = (ra.MODE_SEL, k_sel, v_sel, ra.chosen_bits(idx, blocks), HP["sel_block"])
    if kernel == "selfwd":  # the block-centric selected forward and its merge, beyond the tiled lengths (M7C)
        from nsa.ops.triton import selected_attention as sa

        inverse = sa.build_inverse_index(idx, T, HP["sel_block"])
        o_cmp, o_win = torch.randn_like(q), torch.randn_like(q)
        return {"selected forward": lambda: sa.selected_forward(q, k_sel, v_sel, idx, inverse, o_cmp, o_win, gates,
                                                                scale, HP["sel_block"])}
    if kernel == "selbwd":  # the block-centric (or, for large groups, per-query) selected backward, where it runs
        from nsa.ops.triton import selected_attention as sa

        inverse = sa.build_inverse_index(idx, T, HP["sel_block"])
        _, o_sel, lse = sa.selected_forward(q, k_sel, v_sel, idx, inverse, torch.randn_like(q), torch.randn_like(q),
                                            gates, scale, HP["sel_block"])
        do = torch.randn_like(o_sel)
        delta = (do.float() * o_sel.float()).sum(-1)
        return {"selected backward": lambda: sa.selected_backward(q, k_sel, v_sel, idx, inverse, do, lse, delta,
                                                                  scale, HP["sel_block"])}
    if kernel == "dq":  # all branches in one call; the selected one tiled where it fits, else left out
        sel = qg.SelectedDQ(qg.SEL_NONE)
        lse_g, delta = [], []
        for name in ("compressed", "selected+gated", "window"):  # query_grad's order: cmp, sel, win
            mode, k, v, bits, sel_block = branches.get(name, branches["window"])
            o, lse = ra.range_attention_fwd(q, k, v, mode, scale, 32, 16, HP["window"], bits, sel_block)
            lse_g.append(lse)
            delta.append((o.float() * o.float()).sum(-1))  # any finite delta: only the time is compared
        if "selected+gated" in branches:
            _, k, v, bits, sel_block = branches["selected+gated"]
            sel = qg.SelectedDQ(qg.SEL_TILED, k, v, bits, sel_block=sel_block)
        do = torch.randn_like(q)
        lse_g, delta = torch.stack(lse_g), torch.stack(delta)
        cmp, win = (k_cmp, v_cmp), (k_win, v_win)
        return {"all branches" if sel.kind else "compressed+window": lambda: qg.query_grad(
            q, do, lse_g, delta, scale, 32, 16, HP["window"], cmp, win, sel)}
    out = {}
    for name, (mode, k, v, bits, sel_block) in branches.items():
        args = (q, k, v, mode, scale, 32, 16, HP["window"], bits, sel_block)
        if kernel == "fwd":
            gated = (torch.randn_like(q), torch.randn_like(q), gates) if mode == ra.MODE_SEL else None
            out[name] = lambda args=args, gated=gated: ra.range_attention_fwd(*args, gated)
        else:
            o, lse = ra.range_attention_fwd(*args)
            do = torch.randn_like(o)
            delta = (do.float() * o.float()).sum(-1)
            out[name] = lambda a=args, do=do, lse=lse, delta=delta: ra.range_attention_dkdv(*a[:3], do, lse, delta,
                                                                                            *a[3:])
    return out


# Per kernel: the switch, and the Tuning fields a --configs entry sets (colon-separated, in this order).
KNOBS = {"fwd": ("hopper_forward", ("hopper_block_m", "hopper_stages")),
         "dq": ("hopper_query_grad", ("hopper_dq_block_m", "hopper_dq_stages")),
         "dkdv": ("hopper_backward", ("hopper_dkdv_block_m", "hopper_dkdv_block_n", "hopper_dkdv_stages")),
         "selbwd": ("hopper_selected_backward", ("hopper_dkdv_block_m", "hopper_dkdv_block_n", "hopper_dkdv_stages")),
         "selfwd": ("hopper_selected_forward", ("hopper_selected_forward_stages",))}


def _timed_with(settings: dict[str, str], fn, graphs: bool) -> float:
    """Median GPU ms of fn (Gluon) with these Tuning fields set to these integers, then put back."""
    unknown = [f for f in settings if not hasattr(TUNING, f)]
    if unknown:
        raise SystemExit(f"hopper_ab: {unknown} are not Tuning fields (see nsa/ops/triton/tuning.py)")
    base = {f: getattr(TUNING, f) for f in settings}
    for f, x in settings.items():
        setattr(TUNING, f, type(base[f])(int(x)))
    try:
        run = graphed(fn, graphs)
        return statistics.median(time_cuda(run, queued=True) for _ in range(3))
    finally:
        for f, x in base.items():
            setattr(TUNING, f, x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=sorted(KNOBS), default="fwd")
    p.add_argument("--cases", default="m7c:2048x16,m7c:8192x4,m7c:16384x2,m7c:65536x1,paper:2048x16,"
                                      "paper:8192x4,paper:65536x1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (GPU time alone)")
    p.add_argument("--configs", default="", help="other Gluon settings also timed, e.g. 64:4,128:3 for fwd "
                                                 "(rows:stages) or 32:64:2 for dkdv (rows:keys:stages)")
    p.add_argument("--variants", default="", help="other Tuning settings also timed (Gluon), ';' between variants, "
                                                  "'+' between fields, e.g. hopper_block_m=128+hopper_stages=3")
    ns = p.parse_args()
    switch, fields = KNOBS[ns.kernel]
    rows = []
    for case in ns.cases.split(","):
        shape, size = case.split(":")
        T, batch = (int(x) for x in size.split("x"))
        for branch, fn in calls(shape, T, batch, ns.kernel).items():
            times = {True: [], False: []}
            runs = {}
            for gluon in (True, False):  # a graph fixes the kernel it captured; a plain call reads TUNING
                setattr(TUNING, switch, gluon)
                runs[gluon] = graphed(fn, ns.graphs)
            for _ in range(ns.rounds):
                for gluon in (True, False):
                    setattr(TUNING, switch, gluon)
                    times[gluon].append(time_cuda(runs[gluon], queued=True))
            setattr(TUNING, switch, True)
            gl_ms, tr_ms = statistics.median(times[True]), statistics.median(times[False])
            row = {"shape": shape, "T": T, "batch": batch, "branch": branch, "gluon_ms": gl_ms,
                   "triton_ms": tr_ms, "triton/gluon": tr_ms / gl_ms}
            for config in filter(None, ns.configs.split(",")):  # other tiles and stage counts, Gluon only
                row[f"gluon {config}"] = _timed_with(dict(zip(fields, config.split(":"))), fn, ns.graphs)
            for variant in filter(None, ns.variants.split(";")):
                settings = dict(item.split("=") for item in variant.split("+"))
                row[variant] = _timed_with(settings, fn, ns.graphs)
            rows.append(row)
            print(rows[-1], flush=True)
    print(format_table(rows, list(dict.fromkeys(k for r in rows for k in r))))


if __name__ == "__main__":
    main()
