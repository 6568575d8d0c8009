"""Where a compiled training step's time goes when no CUDA graph replays it (FSDP2's path, or
`parallel.cudagraphs=false`): M7C NSA at 8 x 2048 on one GPU by default.

Prints, for the tree on PYTHONPATH (so an older tree's nsa/ can be timed the same way):
- the step's GPU-paced time (CUDA events between back-to-back steps, as `nsa bench train` times them);
- its host time launched from an idle GPU, and how long the GPU still runs after the host returns (a host that
  returns only when the GPU is done has waited for it somewhere);
- the operations that wait for the GPU during one step (`torch.cuda.set_sync_debug_mode`), with where they are;
- with --profile, the profiler's CPU operations by own and by inclusive time, and the GPU's kernel time a step.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/step_host.py [--phi-torch] [--profile] [key=value ...]'
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

import nsa
from nsa.bench.training import bench_config, step_times_s
from nsa.train.distributed import init_distributed
from nsa.train.loop import Trainer


def _idle_host_ms(step, reps: int) -> tuple[float, float]:
    """(host ms, ms the GPU still ran after the host returned), medians of steps launched from an idle GPU."""
    host, tail = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        host.append(returned - start)
        tail.append(time.perf_counter() - returned)
    return statistics.median(host) * 1e3, statistics.median(tail) * 1e3


def _syncs(step) -> Counter:
    """The Python places (innermost frames outside torch) of the operations that waited for the GPU in one step."""
    places: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # the debug mode's own notice, not a wait
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-3:][::-1])
        places[f"{str(message).splitlines()[0][:60]} @ {where}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return places


def _profile(step, steps: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = {e.key: e.count / steps for e in events if "aunch" in e.key and e.device_type.name == "CPU"}
    print(f"profiler: GPU kernel time {kernel_us / steps / 1e3:.1f} ms a step; launch calls a step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(launches.items())))
    for key in ("self_cpu_time_total", "cpu_time_total"):
        print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--phi-torch", action="store_true", help="phi's MLP as PyTorch operations (Inductor's)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    if args.phi_torch:
        from nsa.model.compression import BlockCompressor

        BlockCompressor._on_triton = lambda self, x: False
    info = init_distributed("auto", 600.0, allow_single_process=True)
    overrides = ["data.tokenizer=byte", "model.vocab_size=50304", "parallel.compile=true",
                 "parallel.cudagraphs=false", *args.overrides]
    config = Path(nsa.__file__).parent.parent / "configs" / "m7c.yaml"  # the timed tree's own
    trainer = Trainer(bench_config(str(config), overrides, "nsa", args.seq_len, args.batch_tokens, 1000), info)
    started = time.perf_counter()
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {trainer.tokens_per_step} tokens a step; "
          f"warm-up {args.warmup} steps {time.perf_counter() - started:.1f} s")
    paced = statistics.median(step_times_s(trainer.train_step, args.steps)) * 1e3
    host, tail = _idle_host_ms(trainer.train_step, 5)
    print(f"step {paced:.1f} ms back to back; from an idle GPU the host returns after {host:.1f} ms and the GPU "
          f"runs {tail:.1f} ms more")
    places = _syncs(trainer.train_step)
    print(f"waits for the GPU in one step: {sum(places.values())}")
    for place, n in places.most_common(12):
        print(f"  {n:4d}  {place}")
    if args.profile:
        _profile(trainer.train_step, 2, args.rows)
    trainer.data.train.close()


if __name__ == "__main__":
    main()
