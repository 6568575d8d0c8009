"""The kernels of one captured NSA forward+backward replay, in start order, with their stream and times: which
kernels run beside each other and which wait (the critical path of a short call, where the SMs are not full).

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/graph_timeline.py [--shape m7c] [--length 4096]'
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nsa.bench.attention import SHAPES, _fwd_bwd, _nsa, make_inputs
from nsa.bench.common import graphed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="m7c", choices=sorted(SHAPES))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    ns = p.parse_args()
    H, G, Dk, Dv = SHAPES[ns.shape]
    ins = make_inputs(ns.length, H, G, Dk, Dv, batch=ns.batch)
    replay = graphed(_fwd_bwd(_nsa(ins), ins))
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    t0 = kernels[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    print(f"{ns.shape} T={ns.length} batch {ns.batch}: {len(kernels)} kernels, replay {end - t0:.1f} us, "
          f"kernel time summed {busy:.1f} us")
    print(f"{'start us':>9s} {'end us':>9s} {'us':>7s} {'stream':>7s}  kernel")
    for e in kernels:
        start = e["ts"] - t0
        print(f"{start:9.1f} {start + e['dur']:9.1f} {e['dur']:7.1f} {e.get('args', {}).get('stream', ''):>7}  "
              f"{e['name'][:90]}")

if __name__ == "__main__":
    main()
