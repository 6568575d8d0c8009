"""What the Gluon selected backward's in-kernel dQ costs it, at M7C 32k x 2 on one selection.

The library kernel (nsa.ops.triton.hopper_selected_backward) called three ways on the same inputs: dQ added into
one float32 dQ with atomics (the default), dQ written as per-slot bf16 shares, and no dQ at all (dK/dV only).
Times are GPU milliseconds of calls queued back to back (nsa.bench.common.time_cuda), medians of 5 rounds; the
zero fills of the accumulators are inside every timed call, as in training.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/history/2026-11-27-h100-s32-ceiling/bwd_dq_probe.py'
"""
import statistics

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import time_cuda
from nsa.ops import select_blocks
from nsa.ops.triton.hopper_selected_backward import selected_backward_hopper
from nsa.ops.triton.selected_attention import build_inverse_index


def main() -> None:
    H, G, D, _ = SHAPES["m7c"]
    sb, n = HP["sel_block"], HP["n_sel"]
    T, B = 32768, 2
    q, k_cmp, v_cmp, k, v, *_ = (x.detach() for x in make_inputs(T, H, G, D, D, batch=B))
    scale = D**-0.5
    idx = select_blocks(q, k_cmp, **{x: HP[x] for x in ("block_len", "block_stride", "sel_block", "n_sel")})
    inv = build_inverse_index(idx, T, sb)
    do = torch.randn_like(q)
    # Row statistics of plausible size: lse ~ log(1024 keys), delta small; the kernel's work does not depend on them.
    lse = torch.full((B, T, H), 7.0, device=q.device)
    delta = 0.01 * torch.randn(B, T, H, device=q.device)
    h = H // G

    def call(write_dq: bool, dq_add: bool):
        dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
        if dq_add:
            dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        else:
            dq = torch.empty(B * G * T * n, h, D, device=q.device, dtype=q.dtype) if write_dq else q
        selected_backward_hopper(q, k, v, do, lse, delta, dk, dv, dq, inv, scale, n, write_dq, False, dq_add)

    runs = {"dQ adds (default)": lambda: call(True, True), "dQ shares": lambda: call(True, False),
            "no dQ": lambda: call(False, False)}
    times = {name: [] for name in runs}
    for _ in range(5):
        for name, fn in runs.items():
            times[name].append(time_cuda(fn, queued=True))
    for name, t in times.items():
        print(f"{name:18s} {statistics.median(t):.3f} ms  (rounds {', '.join(f'{x:.3f}' for x in t)})")


if __name__ == "__main__":
    main()
