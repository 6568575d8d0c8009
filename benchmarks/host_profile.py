"""Where one nsa_attention call's host time goes: cProfile of back-to-back forward+backward calls at batch 1 (the
calls that the attention table's short rows show bound by the host), sorted by own time; with --breakdown, each
stage's host time measured by wall clock around it instead (cProfile mis-counts time under torch.compile's
disabled frames, which the custom ops run in), and every Triton/Gluon launch's.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/host_profile.py [--shape m7c] [--length 4096]'
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time
from collections import defaultdict

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.ops import nsa_attention


def _host_ms(fn, calls: int) -> float:
    """Host ms per call of `calls` back-to-back calls of fn (what the GPU still runs afterwards not counted)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


_STAGES = ("range_attention_fwd", "select_blocks_fwd", "build_inverse_index", "selected_forward", "gate_grads",
           "range_attention_dkdv", "selected_backward", "query_grad")


def _timed(fn, name: str, totals: dict):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += 1
    return wrapper


def layers(ins: list, do: torch.Tensor, calls: int) -> None:
    """Host ms of one call at each layer of the stack: the public op, the custom op, and its implementation run
    directly (the differences are validation, dispatch and autograd)."""
    from nsa.ops.triton import attention

    hyper = (HP["block_len"], HP["block_stride"], HP["sel_block"], HP["n_sel"], HP["window"],
             ins[0].shape[-1] ** -0.5)
    grad_ins = [t.detach().requires_grad_() for t in ins]
    out = attention.nsa_forward._init_fn(*ins, *hyper, True)
    saved = (*ins, *out[1:])

    def fwd_public():
        nsa_attention(*grad_ins, **HP)

    def fwd_op():
        attention.nsa_forward(*ins, *hyper, True)

    def fwd_impl():
        attention.nsa_forward._init_fn(*ins, *hyper, True)

    def bwd_op():
        attention.nsa_backward(do, *saved, *hyper[:3], hyper[4], hyper[5])

    def bwd_impl():
        attention.nsa_backward._init_fn(do, *saved, *hyper[:3], hyper[4], hyper[5])

    def both_public():
        nsa_attention(*grad_ins, **HP).backward(do)

    for name, fn in (("forward, nsa_attention", fwd_public), ("forward, the custom op", fwd_op),
                     ("forward, its implementation", fwd_impl), ("backward, the custom op", bwd_op),
                     ("backward, its implementation", bwd_impl), ("forward+backward, public", both_public)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"{name:32s} {_host_ms(fn, calls):8.3f} ms of host time per call", flush=True)
        torch.cuda.synchronize()


def breakdown(call, calls: int) -> None:
    """Host ms per forward+backward of each stage of nsa::forward/backward (inclusive: a stage's launches are in
    it), of every JIT launch (Triton's run and Gluon's, across stages), and of the calls as a whole."""
    import triton.runtime.jit as jit

    from nsa.ops.triton import attention

    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    saved = {name: getattr(attention, name) for name in _STAGES}
    for name, fn in saved.items():
        setattr(attention, name, _timed(fn, name, totals))
    run = jit.JITFunction.run

    def timed_run(self, *args, **kwargs):
        return _timed(run, f"  launch {getattr(self, '__name__', '?')}", totals)(self, *args, **kwargs)

    jit.JITFunction.run = timed_run
    try:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        totals.clear()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        whole = (time.perf_counter() - start) / calls * 1e3
    finally:
        jit.JITFunction.run = run
        for name, fn in saved.items():
            setattr(attention, name, fn)
    torch.cuda.synchronize()
    print(f"forward+backward, timed stage by stage: {whole:.3f} ms of host time per call")
    launches = [v for k, v in totals.items() if k.startswith("  launch")]
    print(f"JIT launches: {sum(n for _, n in launches) / calls:.1f} per call, "
          f"{sum(s for s, _ in launches) / calls * 1e3:.3f} ms")
    print(f"{'stage':32s} {'ms per call':>12s} {'calls each':>11s}")
    for name, (sec, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:32s} {sec / calls * 1e3:12.3f} {n / calls:11.1f}")


def launch_profile(call, calls: int, rows: int) -> None:
    """cProfile of the JIT launches alone (Triton's run; profiling only inside it keeps torch.compile's frames out)."""
    import triton.runtime.jit as jit

    prof = cProfile.Profile()
    run = jit.JITFunction.run

    def profiled_run(self, *args, **kwargs):
        prof.enable()
        try:
            return run(self, *args, **kwargs)
        finally:
            prof.disable()

    jit.JITFunction.run = profiled_run
    try:
        for _ in range(calls):
            call()
    finally:
        jit.JITFunction.run = run
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="m7c", choices=sorted(SHAPES))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rows", type=int, default=35)
    p.add_argument("--breakdown", action="store_true", help="stage-by-stage wall clock instead of cProfile")
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
    if ns.breakdown:
        layers(ins, do, ns.calls)
        breakdown(lambda: call(True), ns.calls)
        launch_profile(lambda: call(True), ns.calls, ns.rows)
        return
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
