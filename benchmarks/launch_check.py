"""nsa.ops.triton.launcher on a GPU: the same results as Triton's own launch path, and the host time it saves.

    python benchmarks/launch_check.py OUT_DIR

For the M7C shape (nsa.bench.attention) at T = 2048 and 8192, bf16, batch 1:
  (a) nsa_attention's forward output and forward+backward output and gradients, launched through the launcher's fast
      path and through Triton's own path (launcher.disabled()), must be bit-identical (in PyTorch's deterministic
      mode, so that the backward's sums are added in a fixed order);
  (b) host time per eager call (nsa.bench.common.host_ms: the GPU kept busy, median of 50) and time per call as
      a caller sees it (CUDA events, median of 50), both ways.
Writes OUT_DIR/launch_check.json and prints a table. Exit status 1 if any result differs, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from nsa.bench.attention import SHAPES, eager_calls
from nsa.bench.common import host_ms, time_cuda
from nsa.ops.triton import launcher

LENGTHS = (2048, 8192)
SHAPE = "m7c"
CALLS = 50


def _paths(fast: bool):
    """The launcher as it is (fast path after each key's first launch) or Triton's own path for every launch."""
    return contextlib.nullcontext() if fast else launcher.disabled()


def _results(call: Callable) -> list[torch.Tensor]:
    out = call()
    return [t.detach().clone() for t in (out if isinstance(out, list) else [out])]


def identical(call: Callable) -> dict:
    """Whether `call` gives the same bits on both paths (deterministic mode), and the launches per path of the
    compared fast-path call (the call before it has kept every kernel, so it should be all "fast")."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with launcher.disabled():
            reference = _results(call)
        _results(call)  # keeps the compiled kernels of every key this call launches
        seen: collections.Counter = collections.Counter()
        with launcher.observed(lambda kernel, fast, seconds: seen.update(["fast" if fast else "triton"])):
            fast = _results(call)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    same = len(fast) == len(reference) and all(torch.equal(a, b) for a, b in zip(fast, reference))
    return {"identical": same, "launches": dict(seen)}


def timed(call: Callable, fast: bool) -> dict:
    """Host ms of one eager call (nsa bench attention's host time: the GPU kept busy, so that no call waits for it)
    and its ms per call as a caller sees it (CUDA events), both medians."""
    with _paths(fast):
        return {"host_ms": host_ms(call, reps=CALLS), "call_ms": time_cuda(call, min_reps=CALLS, max_reps=CALLS)}


def check_length(T: int) -> list[dict]:
    rows = []
    for name, call in eager_calls(SHAPE, T).items():
        row = {"T": T, "call": name, **identical(call)}
        for fast in (True, False):
            times = timed(call, fast)
            path = "fast" if fast else "triton"
            row.update({f"{k}_{path}": v for k, v in times.items()})
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'T':>6} {'call':<17} {'same bits':>9} {'launches fast/triton':>20} "
             f"{'host ms fast':>12} {'triton':>7} {'call ms fast':>12} {'triton':>7}"]
    for r in rows:
        launches = f"{r['launches'].get('fast', 0)}/{r['launches'].get('triton', 0)}"
        lines.append(f"{r['T']:>6} {r['call']:<17} {str(r['identical']):>9} {launches:>20} "
                     f"{r['host_ms_fast']:>12.3f} {r['host_ms_triton']:>7.3f} {r['call_ms_fast']:>12.3f} "
                     f"{r['call_ms_triton']:>7.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_check.py: needs a CUDA GPU (it times kernel launches)", file=sys.stderr)
        return 2
    import triton

    rows = [row for T in LENGTHS for row in check_length(T)]
    H, G, Dk, Dv = SHAPES[SHAPE]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": f"{SHAPE} {H}/{G}/{Dk}", "dtype": "bfloat16", "batch": 1, "calls": CALLS, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "launch_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  {report['shape']} bf16 B=1")
    print(table(rows))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
