"""Where the host's time in one eager NSA attention call goes (CUDA): each Triton kernel's launches per call and host
microseconds per launch (by path: nsa.ops.triton.launcher's fast path, Triton's own path through it, or a direct
launch), the share of the call they take, and a cProfile of everything, for an inference forward (no grad), a
training forward and a forward+backward.

    python benchmarks/host_profile.py OUT_DIR [--shape m7c|paper] [--length T] [--calls N] [--triton-path]

Writes OUT_DIR/host_profile.txt (and prints it). `nsa bench attention` reports the host time per call; this says
what it is made of, so that fewer or cheaper launches can be aimed at the right places.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

from nsa.bench.attention import SHAPES, eager_calls
from nsa.ops.triton import launcher


class LaunchTimer:
    """Host seconds and counts of launches per kernel and path. Launches through nsa.ops.triton.launcher are timed
    whole (key, look-up and launch) by its observer hook, as its fast path ("fast") or Triton's own ("triton");
    launches that do not go through it (the Gluon kernels) are timed around JITFunction.run ("direct")."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()
        self.kernels: dict[int, object] = {}  # counted by id: a JITFunction's own hash reads its cache key
        self.routed: set[int] = set()  # ids of kernels seen by the launcher
        self._run = JITFunction.run
        timer = self

        def timed_run(fn_self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return timer._run(fn_self, *args, **kwargs)
            finally:
                timer.add(fn_self, "direct", time.perf_counter() - start)

        JITFunction.run = timed_run
        self._observing = launcher.observed(self.observe)
        self._observing.__enter__()

    def observe(self, kernel, fast: bool, seconds: float) -> None:
        self.routed.add(id(kernel))
        self.add(kernel, "fast" if fast else "triton", seconds)

    def add(self, kernel, path: str, seconds: float) -> None:
        self.kernels[id(kernel)] = kernel
        self.seconds[id(kernel), path] += seconds
        self.counts[id(kernel), path] += 1

    def rows(self) -> list[tuple[str, str, int, float]]:
        """(kernel name, path, launches, seconds), most seconds first. A routed kernel's "direct" launches are the
        JITFunction.run inside its "triton" ones, already counted there."""
        rows = [(_name(self.kernels[key]), path, self.counts[key, path], seconds)
                for (key, path), seconds in self.seconds.items() if not (path == "direct" and key in self.routed)]
        return sorted(rows, key=lambda row: -row[3])

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def _name(kernel) -> str:
    return kernel.fn.__name__ + (" (gluon)" if kernel.is_gluon() else "")


def profile_call(name: str, call, calls: int, timer: LaunchTimer) -> str:
    """The report of `calls` eager calls of `call` (after three warm-up calls)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    timer.reset()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host_ms = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    rows = timer.rows()
    launches = sum(row[2] for row in rows) / calls
    launch_ms = sum(row[3] for row in rows) / calls * 1e3
    lines = [f"== {name}: host {host_ms:.3f} ms a call; {launches:.0f} Triton launches taking {launch_ms:.3f} ms "
             f"({launch_ms / host_ms:.0%})", f"{'kernel':<34} {'path':>6} {'launches/call':>13} {'us/launch':>10}"]
    for kernel, path, count, seconds in rows:
        lines.append(f"{kernel:<34} {path:>6} {count / calls:>13.1f} {seconds / count * 1e6:>10.1f}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    lines.append(f"cProfile of {calls} calls, by own time:")
    lines.append(text.getvalue().split("\n\n", 1)[-1].strip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="m7c")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--triton-path", action="store_true",
                        help="every launch through Triton's own path (nsa.ops.triton.launcher.disabled()), to compare")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_profile.py: needs a CUDA GPU (it times kernel launches)", file=sys.stderr)
        return 2
    timer = LaunchTimer()
    H, G, Dk, _ = SHAPES[args.shape]
    reports = [f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.shape} {H}/{G}/{Dk}  T={args.length}"
               + ("  (launcher's fast path off)" if args.triton_path else "")]
    with launcher.disabled() if args.triton_path else contextlib.nullcontext():
        for name, call in eager_calls(args.shape, args.length).items():
            reports.append(profile_call(name, call, args.calls, timer))
    text = "\n\n".join(reports)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "host_profile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
