"""Shared benchmark plumbing: CUDA-event timing, profiles, environment facts, table and CSV/JSON output, CUDA graphs."""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..ops.tuning import TUNING, Tuning
from ..telemetry.environment import git_revision, versions


def time_cuda(fn, *, warmup: int = 2, min_reps: int = 3, max_reps: int = 50, budget_ms: float = 400.0,
              queued: bool = False) -> float:
    """Median milliseconds of fn() measured with CUDA events, after warm-up.

    Each call is timed alone (host launch time included, as a caller sees it), or with `queued` the calls
    run back to back and the mean is returned: the GPU's time per call, the host's launches hidden behind
    the previous call's kernels (a stage's share of a larger job, where the GPU is the bottleneck).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    reps = int(min(max_reps, max(min_reps, budget_ms // max(first, 1e-3))))
    if queued:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, *, reps: int = 20, gpu_busy_s: float = 0.5) -> float:
    """Median milliseconds the host spends issuing one call of fn(), the GPU kept busy meanwhile (a queued spin
    kernel), so that no call waits for the GPU: Python, dispatch, autograd and kernel launches alone. Against
    time_cuda's per-call time it tells whether a call is paced by the host or by the GPU."""
    fn()
    torch.cuda.synchronize()
    rate_hz = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate * 1e3  # kHz -> Hz
    torch.cuda._sleep(int(rate_hz * gpu_busy_s))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_to_file(fn, path: Path, *, repeats: int = 1, rows: int = 40) -> int:
    """fn() `repeats` times under the PyTorch profiler; writes its ops by self device time (CPU time without a
    GPU) as a text table with the kernels launched per call first, and returns that count (0 on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if cuda and e.device_type == torch.autograd.DeviceType.CUDA) // repeats
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    busy = ""
    if cuda:
        ms, gaps = gpu_busy_ms(prof.events())
        busy = (f"GPU busy {ms / repeats:.2f} ms per call (kernels' union); idle gaps over 0.1 ms between the first "
                f"and last kernel: {gaps / repeats:.2f} ms per call\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{kernels} GPU kernels per call (mean over {repeats})\n" + busy
                    + events.table(sort_by=sort, row_limit=rows, max_name_column_width=70))
    return kernels


def gpu_busy_ms(events) -> tuple[float, float]:
    """(time some kernel runs, idle time in gaps over 0.1 ms) of a profile's GPU events, in ms. Compared with
    an unprofiled call's wall time, the first says how much of a step the GPU waits for the host."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps = busy_and_gaps(spans)
    return busy / 1e3, sum(g for g, _ in gaps if g > 100) / 1e3


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, int]]]:
    """For (start, end) spans sorted by start: the length of their union, and each idle gap as (length, index of
    the span that ends it)."""
    busy, end, gaps = 0.0, None, []
    for i, (a, b) in enumerate(spans):
        if end is not None and a > end:
            gaps.append((a - end, i))
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps


def environment() -> dict:
    v = versions()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        **{k: v[k] for k in ("torch", "triton", "cuda", "python")},
        "git": git_revision(),
        "fla": v["fla"],
        "tuning": tuning_changes(),
    }


def tuning_changes() -> dict:
    """The launch parameters and kernel switches of TUNING that differ from their defaults (e.g. --gluon-packed)."""
    return {f.name: getattr(TUNING, f.name) for f in dataclasses.fields(Tuning) if getattr(TUNING, f.name) != f.default}


def write_results(rows: list[dict], out_dir: str | Path, name: str, meta: dict) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{name}.csv", out / f"{name}.json"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"environment": meta, "rows": rows}, indent=1))
    return csv_path, json_path


def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_row(row: dict, columns: list[str]) -> None:
    """One row of format_table(..., columns) without its header, printed at once: progress of a long benchmark."""
    print(format_table([row], columns).splitlines()[-1], flush=True)


def graphed(fn: Callable[[], object], use_graph: bool = True) -> Callable[[], object]:
    """fn captured in a CUDA graph (warmed up on a side stream first), or fn itself."""
    if not use_graph:
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(fn: Callable[[], object] = fn) -> None:
        # The graph reads fn's inputs where they were at capture: holding fn (and what its closure holds) keeps
        # them from being freed and overwritten while the replay exists.
        graph.replay()

    return replay
