"""`nsa bench decode`: per-token decode latency with the KV caches, NSA against dense, in one run.

Each row builds the model (random weights, bf16 on the GPU), prefills a random prompt of the
given context length, then times decode steps replayed from CUDA graphs (GraphedDecoder: both
models pay kernel time, not Python dispatch): the mean over whole cycles of d steps, as NSA runs
phi only on the steps that complete a compressed block. Also timed: one layer's decode attention alone (NSA's
compressed + selected + window branches against SDPA over the dense cache), where NSA's smaller
reads show directly; the whole-model step also reads every weight once (~250 MB for M7C). Each row also gives
the bytes a step and a layer's attention must read (nsa.bench.byte_floor), the share of the floor (those bytes
at the bandwidth of a large copy, measured once per run) the measured time reaches, and the prompt's prefill time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..config import load_config
from ..errors import UserError
from ..inference.attention import decode_attention, dense_decode_attention
from ..inference.cache import new_cache
from ..inference.decode import prefill
from ..inference.graphed import GraphedDecoder
from ..model import Transformer
from ..plots.bench import picture
from .byte_floor import attention_bytes, copy_bandwidth, step_bytes
from .common import environment, format_table, graphed, print_row, profile_to_file, write_results


PROFILE_STEPS = 5
"""Decode steps run under the profiler with --profile (the kernel count is their mean)."""


def _mean_ms(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    return statistics.mean(_times_ms(fn, reps, cuda))


def _median_ms(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    return statistics.median(_times_ms(fn, reps, cuda))


def _times_ms(fn: Callable[[], object], reps: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _layer_attention_ms(model: Transformer, cache, batch: int, reps: int, cuda: bool) -> float:
    """One layer's decode attention for a query at the last prompt position."""
    attn, layer = model.layers[0].attn, cache.layers[0]
    device = next(model.parameters()).device
    q = torch.randn(batch, attn.n_heads, attn.head_dim, device=device, dtype=layer.k.dtype)
    positions = cache.lengths - 1
    if hasattr(attn, "gate"):
        gates = torch.rand(batch, attn.n_heads, 3, device=device, dtype=q.dtype)
        fn = lambda: decode_attention(q, gates, layer, positions)  # noqa: E731
    else:
        fn = lambda: dense_decode_attention(q, layer, positions)  # noqa: E731
    return _median_ms(graphed(fn, cuda), reps, cuda)


def _floors(model: Transformer, context: int, batch: int, step_ms: float, attn_ms: float,
            bandwidth: float | None) -> dict:
    """Bytes a step and a layer's attention read, and the share of the time reading them at `bandwidth` takes that
    the measured times reach (1.0: at the floor)."""
    step_b = step_bytes(model, context, batch)
    attn_b = attention_bytes(model.cfg, context, batch, next(model.parameters()).element_size())
    row = {"step_mb": step_b / 1e6, "layer_attention_mb": attn_b / 1e6}
    if bandwidth:
        row["step_floor_share"] = step_b / bandwidth * 1e3 / step_ms
        row["attention_floor_share"] = attn_b / bandwidth * 1e3 / attn_ms
    return row


PROGRESS_COLUMNS = ["attention", "compiled", "context", "batch", "step_ms", "tokens_per_s", "layer_attention_ms"]


@torch.no_grad()
def measure(cfg, attention: str, context: int, batch: int, steps: int, device: torch.device,
            compile: bool = False, profile_dir: str | None = None, bandwidth: float | None = None) -> dict:
    """One row: the step's time and its share of the byte floor (at `bandwidth` bytes/s), one layer's decode
    attention alike, and the prefill of the prompt."""
    model_cfg = dataclasses.replace(cfg.model, attention=attention)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch._dynamo.reset()  # a fresh compile per model, not guard failures piling up against the cache limit
    torch.manual_seed(0)
    model = Transformer(model_cfg).to(device=device, dtype=dtype).eval()
    # Whole cycles of d steps, so that steps with and without an emitted block count in their proportion.
    cycle = cfg.model.nsa.block_stride
    steps = -(-steps // cycle) * cycle
    cache = new_cache(model, batch, context + cycle + steps + PROFILE_STEPS)
    prompt = torch.randint(0, model_cfg.vocab_size, (batch, context), device=device)
    prefill(model, prompt, cache)
    token = torch.zeros(batch, dtype=torch.long, device=device)
    cuda = device.type == "cuda"
    decoder = GraphedDecoder(model, cache, compile=compile)
    for _ in range(cycle):  # captures both variants (with and without the compressed emission)
        decoder(token)
    step_ms = _mean_ms(lambda: decoder(token), steps, cuda)
    reads = cache.layers[0].reads.float().mean().item() if hasattr(cache.layers[0], "reads") else None
    attn_ms = _layer_attention_ms(model, cache, batch, steps, cuda)
    row = {"attention": attention, "compiled": compile, "context": context, "batch": batch, "step_ms": step_ms,
           "tokens_per_s": batch / step_ms * 1e3, "layer_attention_ms": attn_ms, "reads_per_group": reads,
           **_floors(model, context, batch, step_ms, attn_ms, bandwidth),
           "prefill_ms": _median_ms(lambda: prefill(model, prompt, cache), 1, cuda)}  # compiled by the first
    if profile_dir:
        # Outside a CUDA graph, so the profiler sees each kernel of the step (a replay is one opaque launch).
        name = f"profile_decode_{attention}{'_compiled' if compile else ''}_{context}_b{batch}.txt"
        row["kernels_per_step"] = profile_to_file(lambda: decoder.step_eagerly(token), Path(profile_dir) / name,
                                                  repeats=PROFILE_STEPS)
    del model, cache
    if cuda:
        torch.cuda.empty_cache()
    return row


def run(config: str | None, overrides: list[str], contexts: list[int], batches: list[int], attentions: list[str],
        steps: int, out_dir: str, device: str = "cuda", compile: bool = False, profile: bool = False) -> list[dict]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("nsa bench decode needs a CUDA GPU (or --device cpu for a slow functional run)")
    cfg = load_config(config, overrides)
    if cfg.model.vocab_size < 1:
        raise UserError("set model.vocab_size (e.g. 50304) for the benchmark's random-weight model")
    meta = environment() | {"config": config or "defaults", "overrides": overrides, "steps": steps,
                            "dtype": "bf16" if dev.type == "cuda" else "fp32", "cuda_graphs": dev.type == "cuda",
                            "compiled": compile}
    print(f"{meta['device']}  torch {meta['torch']}", flush=True)
    name = "decode_compiled" if compile else "decode"
    meta["copy_bandwidth_gb_s"] = bandwidth = copy_bandwidth(dev, 512 if dev.type == "cuda" else 32) / 1e9
    print(f"memory bandwidth (a large copy): {bandwidth:,.0f} GB/s", flush=True)
    rows, paths = [], ()
    for b in batches:
        for T in contexts:
            for a in attentions:
                # Each row takes minutes with --compile (compiles and graph captures): show it as it lands, and
                # write the results so far, so that a run cut short keeps every row it measured.
                print(f"{a}, context {T:,}, batch {b}: prefill, {'compile, ' if compile else ''}capture, time",
                      flush=True)
                rows.append(measure(cfg, a, T, b, steps, dev, compile, out_dir if profile else None,
                                    bandwidth * 1e9))
                print_row(rows[-1], PROGRESS_COLUMNS)
                paths = write_results(_with_ratios(rows), out_dir, name, meta)
    columns = ["attention", "compiled", "context", "batch", "step_ms", "tokens_per_s", "speedup", "step_mb",
               "step_floor_share", "layer_attention_ms", "attention_speedup", "layer_attention_mb",
               "attention_floor_share", "prefill_ms", "reads_per_group", "kernels_per_step"]
    print("\n" + format_table(rows, [c for c in columns if any(c in r for r in rows)]))
    paths += picture(rows, meta, Path(out_dir) / f"{name}.png")
    print("wrote " + ", ".join(map(str, paths)))
    return rows


def _with_ratios(rows: list[dict]) -> list[dict]:
    """rows with each one's speed-ups over the dense row of its context and batch (None until that one lands)."""
    for row in rows:
        dense = next((r for r in rows if r["attention"] == "dense" and r["context"] == row["context"]
                      and r["batch"] == row["batch"]), None)
        row["speedup"] = dense["step_ms"] / row["step_ms"] if dense else None
        row["attention_speedup"] = dense["layer_attention_ms"] / row["layer_attention_ms"] if dense else None
    return rows
