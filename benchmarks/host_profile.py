"""Where one nsa_attention call's host time goes: cProfile of back-to-back forward+backward calls at batch 1 (the
calls that the attention table's short rows show bound by the host), sorted by own time.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/host_profile.py [--shape m7c] [--length 4096]'
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.ops import nsa_attention


def _host_ms(fn, calls: int) -> float:
    """Host ms per call of `calls` back-to-back calls of fn (what the GPU still runs afterwards not counted)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="m7c", choices=sorted(SHAPES))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rows", type=int, default=35)
    ns = p.parse_args()
    H, G, Dk, Dv = SHAPES[ns.shape]
    ins = make_inputs(ns.length, H, G, Dk, Dv)
    do = torch.randn(1, ns.length, H, Dv, device="cuda", dtype=torch.bfloat16)

    def call(backward: bool) -> None:
        out = nsa_attention(*ins, **HP)
        if backward:
            out.backward(do)

    for backward in (False, True):
        for _ in range(3):
            call(backward)
        torch.cuda.synchronize()
        start = time.perf_counter()
        host = _host_ms(lambda: call(backward), ns.calls)
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - start) / ns.calls * 1e3
        print(f"{'forward+backward' if backward else 'forward'}: {host:.3f} ms of host time per call, "
              f"{gpu:.3f} ms until the GPU is done", flush=True)
    # With the GPU held busy first, a call that waits for it somewhere (a host read of a device value) shows its
    # host time grown by the wait; CUDA's sync debug mode names such operations.
    torch.cuda._sleep(int(2e8))
    busy = _host_ms(lambda: call(True), 10)
    print(f"forward+backward behind a busy GPU: {busy:.3f} ms of host time per call", flush=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    call(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(ns.calls):
        call(True)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(ns.rows)
    stats.sort_stats("cumulative").print_stats(ns.rows)


if __name__ == "__main__":
    main()
