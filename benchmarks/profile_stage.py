"""One NSA forward+backward at the given shape and length on a GPU, for Nsight Compute to profile chosen kernels.

    python3 benchmarks/profile_stage.py SHAPE T [BATCH] [--table OUT_DIR]
    ncu -k regex:_select_kernel --launch-count 1 --section SpeedOfLight python3 benchmarks/profile_stage.py m7c 65536

SHAPE is m7c (12/2/64) or paper (64/4/128). With --table OUT_DIR: times the forward+backward instead (CUDA events
three times, then 20 steps back to back: wall time and the host's launch time per step) and writes the PyTorch
profiler's kernels by time to OUT_DIR/prof_<shape>_<T>_b<batch>.txt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import profile_to_file, time_cuda
from nsa.ops import nsa_attention


def forward_backward(ins: list[torch.Tensor]) -> Callable[[], None]:
    """One NSA forward and backward on `ins`, the previous call's gradients dropped first."""
    grad_out = None

    def step() -> None:
        nonlocal grad_out
        for t in ins:
            t.grad = None
        out = nsa_attention(*ins, **HP)
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)

    return step


def table(step: Callable[[], None], path: Path) -> None:
    """Time `step` and write the profiler's kernel table to `path`."""
    print("fwd+bwd ms (CUDA events, 3 samples)", [round(time_cuda(step), 4) for _ in range(3)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"wall ms/step {(t2 - t0) / 20 * 1e3:.3f}  host launch ms/step {(t1 - t0) / 20 * 1e3:.3f}")
    profile_to_file(step, path, repeats=3, rows=25)
    print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("T", type=int)
    parser.add_argument("batch", type=int, nargs="?", default=1)
    parser.add_argument("--table", metavar="OUT_DIR", help="time, and write the profiler's kernel table here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    H, G, Dk, Dv = SHAPES[args.shape]
    step = forward_backward(make_inputs(args.T, H, G, Dk, Dv, batch=args.batch))
    print(f"{args.shape} T={args.T} batch={args.batch}")
    if args.table is None:
        step()
        torch.cuda.synchronize()
        print("profiled one forward+backward")
        return
    table(step, Path(args.table) / f"prof_{args.shape}_{args.T}_b{args.batch}.txt")


if __name__ == "__main__":
    main()
