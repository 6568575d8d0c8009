"""Alternating A/B of one boolean tuning knob (e.g. TUNING.branch_streams) on NSA forward+backward, M7C shapes.

    python3 benchmarks/tuning_ab.py [--param branch_streams] [--cases 2048x64,8192x16,2048x32] [--rounds 6]
                                    [--steps 20]

Each sample queues `steps` forward+backward calls back to back and times them with CUDA events; rounds alternate
which setting goes first, so drift between samples (clocks, temperature) falls on both sides. A case whose host
time per call exceeds its GPU time measures the host (e.g. the side stream's event bookkeeping): double the batch
to see the GPU's share.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from nsa.bench.attention import _fwd_bwd, _nsa, make_inputs
from nsa.bench.common import time_cuda
from nsa.ops.triton.tuning import TUNING


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--param", default="branch_streams", help="a boolean field of nsa.ops.triton.tuning.Tuning")
    ap.add_argument("--cases", default="2048x64,8192x16,2048x32", help="TxB,... (M7C: 12/2/64)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    shipped = getattr(TUNING, args.param, None)
    if not isinstance(shipped, bool):
        ap.error(f"--param {args.param}: not a boolean field of Tuning")
    for case in args.cases.split(","):
        T, B = (int(x) for x in case.split("x"))
        ins = make_inputs(T, 12, 2, 64, 64, batch=B)
        step = _fwd_bwd(_nsa(ins), ins)
        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for r in range(args.rounds + 1):  # round 0 warms both settings up
                for on in (True, False) if r % 2 else (False, True):
                    setattr(TUNING, args.param, on)
                    ms = time_cuda(step, warmup=1, min_reps=args.steps, max_reps=args.steps, queued=True)
                    if r:
                        times[on].append(ms)
        finally:
            setattr(TUNING, args.param, shipped)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"M7C {T}x{B}: {args.param} on {on:.3f} ms, off {off:.3f} ms, off/on {off / on:.3f} "
              f"(samples on {[round(x, 2) for x in times[True]]}, off {[round(x, 2) for x in times[False]]})",
              flush=True)


if __name__ == "__main__":
    main()
