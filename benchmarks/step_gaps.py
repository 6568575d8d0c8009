"""Where a training step leaves the GPU idle: the largest gaps between kernels and the host code that ends each.

    PYTHONPATH=$PWD python3 benchmarks/step_gaps.py configs/m7c.yaml --attention nsa --seq-len 2048 [key=value ...] [--out DIR]

Builds the trainer as `nsa bench train` does (synthetic tokens), runs warm-up steps, then times steps without the
profiler (wall) and profiles one (kernels). Prints the wall time, the kernels' union, and the largest idle gaps,
each with the kernels around it and the host ops that were running when the kernel after it was launched. The
profiler slows the host, so gaps under it are upper bounds; wall minus busy is the unprofiled idle time.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from nsa.bench.common import busy_and_gaps
from nsa.bench.training import bench_config
from nsa.train.distributed import init_distributed
from nsa.train.loop import Trainer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("config")
parser.add_argument("overrides", nargs="*")
parser.add_argument("--attention", default="nsa")
parser.add_argument("--seq-len", type=int, default=2048)
parser.add_argument("--batch-tokens", type=int, default=65536)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--gaps", type=int, default=15)
parser.add_argument("--back-to-back", type=int, default=1,
                    help="profile this many steps launched back to back; with more than one, only gaps after the "
                         "first step are listed, and each step's host time is printed")
parser.add_argument("--out", help="folder for the chrome trace of the profiled step")
ns = parser.parse_args()

if not torch.cuda.is_available():
    raise SystemExit("step_gaps.py needs a CUDA GPU")
info = init_distributed("auto", 600.0, allow_single_process=True)
cfg = bench_config(ns.config, ns.overrides, ns.attention, ns.seq_len, ns.batch_tokens, 2 * ns.steps + 4)
trainer = Trainer(cfg, info)
for _ in range(3):
    trainer.train_step()
torch.cuda.synchronize()
walls = []
for _ in range(ns.steps):
    start = time.perf_counter()
    trainer.train_step()[0].item()
    walls.append((time.perf_counter() - start) * 1e3)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    # Back to back as in training (--back-to-back N): the steps after the first show the steady state, where the
    # host runs ahead unless its own time per step exceeds the GPU's.
    for i in range(ns.back_to_back):
        with record_function(f"train_step {i}"):
            out = trainer.train_step()
    out[0].item()
trace = Path(ns.out or "/tmp") / f"step_{ns.attention}_{ns.seq_len}.json"
trace.parent.mkdir(parents=True, exist_ok=True)
prof.export_chrome_trace(str(trace))
events = json.loads(trace.read_text())["traceEvents"]
kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
cpu_ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e]


def host_stack(kernel: dict) -> str:
    """Names of the host ops that enclose the launch of this kernel, outermost first."""
    launch = launches.get(kernel["args"].get("correlation"))
    if launch is None:
        return "?"
    ts, tid = launch["ts"], launch["tid"]
    around = [e for e in cpu_ops if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]
    return " > ".join(e["name"][:40] for e in sorted(around, key=lambda e: e["ts"]))[-200:]


if not kernels:
    raise SystemExit("the profiled step launched no GPU kernels (this needs a CUDA GPU)")
busy, gaps = busy_and_gaps([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
first = kernels[0]["ts"]
print(f"{ns.attention} seq {ns.seq_len}: wall {statistics.median(walls):.1f} ms a step (median of {ns.steps}, "
      f"no profiler); kernels' union {busy / 1e3:.1f} ms; {len(kernels)} kernels; "
      f"idle between first and last kernel {sum(g for g, _ in gaps) / 1e3:.1f} ms (profiled)")
if ns.back_to_back > 1:
    steps = sorted((e for e in cpu_ops if e["name"].startswith("train_step ")), key=lambda e: e["ts"])
    print("host ms per step (launching, profiled):", " ".join(f"{e['dur'] / 1e3:.1f}" for e in steps))
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - first
    later = [(g, i) for g, i in gaps if kernels[i]["ts"] - first > span / ns.back_to_back]
    print(f"GPU span {span / 1e3:.1f} ms for {ns.back_to_back} steps; idle after the first step "
          f"{sum(g for g, _ in later) / 1e3 / (ns.back_to_back - 1):.2f} ms a step")
    gaps = later
print(f"{'gap ms':>7} {'at ms':>7}  before -> after  | host ops launching the kernel after")
for gap, i in sorted(gaps, reverse=True)[: ns.gaps]:
    before, after = kernels[i - 1], kernels[i]
    print(f"{gap / 1e3:7.2f} {(after['ts'] - first) / 1e3:7.1f}  {before['name'][:38]} -> {after['name'][:38]}  | "
          f"{host_stack(after)}")
