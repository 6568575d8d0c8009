"""`nsa bench train`: training throughput, MFU and peak memory, NSA against dense in the same run.

It runs the real trainer (`Trainer.train_step`) on synthetic tokens, so parallelism, activation
checkpointing and compilation are exactly what `nsa train` does; the steps run back to back, as in a run, and
a row's step time is the median of the steps' CUDA-event intervals. Under torchrun it measures the
multi-GPU job (tokens/s summed over ranks); compare with a 1-process run of the same command.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..config import RunConfig, load_config
from ..errors import UserError
from ..model.attention import SDPA_BACKENDS
from ..plots.bench import dense_references, picture, ratio_column
from ..train.distributed import DistInfo, all_reduce_mean, init_distributed, shutdown
from ..train.loop import Trainer, step_kind
from ..train.tf32 import tf32_matmuls
from .common import environment, format_table, print_row, profile_to_file, write_results

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 datasheet peaks used for MFU (override with --peak-tflops)."""


def attention_keys_per_query(cfg, seq_len: int) -> float:
    """Average keys one query attends to: T/2 for dense causal; compressed + selected + window for NSA."""
    if cfg.model.attention == "dense":
        return seq_len / 2
    n = cfg.model.nsa
    compressed = max(0.0, (seq_len - n.block_len) / n.block_stride) / 2
    return compressed + min(seq_len / 2, n.n_sel * n.sel_block) + min(seq_len / 2, n.window)


def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    """6 N for the weights (embeddings excluded) plus 12 L H D keys for attention, forward and backward."""
    m = cfg.model
    non_embedding = n_params - m.vocab_size * m.dim
    return 6 * non_embedding + 12 * m.n_layers * m.n_heads * m.head_dim * attention_keys_per_query(cfg, seq_len)


def _peak_tflops(override: float | None) -> float:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0)


def _health_probe_ms(trainer: Trainer, reps: int = 5) -> float | None:
    """Median time of one NSA health-statistics record (probe, cross-rank sum, summary) as in training."""
    if trainer.cfg.model.attention != "nsa" or trainer.cfg.telemetry.health_every <= 0:
        return None
    times = []
    for _ in range(reps):
        trainer.health_step = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.health_record(is_last=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_times_s(step, steps: int) -> list[float]:
    """Seconds per step of `steps` calls run back to back, as `nsa train` runs them (its host reads the GPU only
    on logging steps, and lets it run two steps ahead), timed by CUDA events recorded between the steps.

    Timing each step from the host with a sync after it would leave the GPU idle while the next step's first
    kernels are launched, time that a training run does not spend.
    """
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        step()
        marks[i + 1].record()
    marks[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def profiled_step(step, path: Path, is_main: bool) -> None:
    """One more step on every rank, whose GPU kernels rank 0 writes to `path` by total time.

    Every rank must take it: the step holds the gradient all-reduce, so a step on rank 0 alone would wait for
    the other ranks until the process group's timeout.
    """
    if is_main:
        profile_to_file(step, path, rows=250)
    else:
        step()


PROGRESS_COLUMNS = ["attention", "seq_len", "batch_per_rank", "ranks", "tokens_per_s", "peak_mem_gb", "step_ms"]


def model_overrides(attention: str) -> list[str]:
    """The model keys of one row's label: 'nsa', 'dense' (SDPA's own choice of kernel) or 'dense:BACKEND' (SDPA
    pinned to model.dense_backend=BACKEND, e.g. dense:flash, the reference of docs/performance.md)."""
    kind, _, backend = attention.partition(":")
    if kind == "nsa" and not backend:
        return ["model.attention=nsa"]
    if kind == "dense" and backend in ("", *SDPA_BACKENDS):
        return ["model.attention=dense", f"model.dense_backend={backend or 'auto'}"]
    raise UserError(f"unknown --attention entry {attention!r}; use nsa, dense or dense:BACKEND with BACKEND one of "
                    f"{', '.join(SDPA_BACKENDS)}")


def bench_config(config: str | None, overrides: list[str], attention: str, seq_len: int, batch_tokens: int,
                 steps: int):
    """The training config of one benchmark row: synthetic tokens unless `overrides` name a data source (e.g.
    data.source=embedded data.document_masking=true, to time masking on real documents), no evaluation or
    sampling, nothing resumed."""
    batch = max(1, batch_tokens // seq_len)
    # One folder name for every rank: the ranks check that they were given the same config.
    out = Path(tempfile.gettempdir()) / "nsa-bench-train"
    return load_config(config, [
        "data.source=synthetic", "data.tokenizer=byte",
        *overrides, *model_overrides(attention), f"train.seq_len={seq_len}", f"train.batch_size={batch}",
        "data.val_fraction=0", "train.progress=false",
        "train.sample_tokens=0", f"train.out_dir={out}", f"train.run_name={attention.replace(':', '-')}-{seq_len}",
        "checkpoint.resume=none", f"train.steps={steps}",
    ])


def bench_trainer(cfg: RunConfig, info: DistInfo) -> Trainer:
    """A Trainer for one benchmark row, its run folder (telemetry files only) in cfg.train.out_dir."""
    run_dir = Path(cfg.train.out_dir) / cfg.train.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, info, run_dir)


def measure(config: str | None, overrides: list[str], attention: str, seq_len: int, batch_tokens: int, steps: int,
            warmup: int, info: DistInfo, profile_dir: str | None = None) -> dict:
    batch = max(1, batch_tokens // seq_len)
    torch._dynamo.reset()  # each shape compiles static, as in a real run, not as a dynamic-shape recompile
    # From the start: under parallel.cudagraphs the warm-up steps record the graphs, whose memory the timed
    # replays reuse without allocating.
    torch.cuda.reset_peak_memory_stats()
    trainer = bench_trainer(bench_config(config, overrides, attention, seq_len, batch_tokens, warmup + steps + 1),
                            info)
    for _ in range(warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    times = step_times_s(trainer.train_step, steps)
    health_ms = _health_probe_ms(trainer)
    if profile_dir:
        profiled_step(trainer.train_step, Path(profile_dir) / f"profile_{attention}_{seq_len}.txt", info.is_main)
    trainer.data.train.close()
    step_s = all_reduce_mean(torch.tensor(statistics.median(times), device=info.device), info).item()
    peak_gb = torch.cuda.max_memory_allocated() / 2**30
    tok_s = trainer.tokens_per_step / step_s
    flops = flops_per_token(trainer.cfg, trainer.n_params, seq_len)
    row = {"attention": attention, "seq_len": seq_len, "batch_per_rank": batch, "ranks": info.world_size,
           "mode": trainer.mode, "step": step_kind(trainer.parallel), "tokens_per_s": tok_s,
           "mfu": tok_s * flops / (info.world_size * _peak_tflops(None) * 1e12), "peak_mem_gb": peak_gb,
           "step_ms": step_s * 1e3, "health_ms": health_ms,
           "health_cost": health_ms / (trainer.cfg.telemetry.health_every * step_s * 1e3) if health_ms else None}
    del trainer
    torch.cuda.empty_cache()
    return row


def _with_ratios(rows: list[dict]) -> list[dict]:
    """rows with each one's tokens/s over every dense row of its length (None until that one lands): vs_dense
    against SDPA's own choice, vs_dense_BACKEND against a pinned kernel."""
    for row in rows:
        for ref in dense_references(rows):
            dense = next((r for r in rows if r["attention"] == ref and r["seq_len"] == row["seq_len"]), None)
            row[ratio_column(ref)] = row["tokens_per_s"] / dense["tokens_per_s"] if dense else None
    return rows


def table_columns(rows: list[dict]) -> list[str]:
    """The summary table's columns: one ratio per dense reference in the run."""
    ratios = [ratio_column(ref) for ref in dense_references(rows)]
    return ["attention", "seq_len", "batch_per_rank", "ranks", "mode", "step", "tokens_per_s", *(ratios or ["vs_dense"]),
            "mfu", "peak_mem_gb", "step_ms", "health_ms", "health_cost"]


def run(config: str | None, overrides: list[str], seq_lens: list[int], attentions: list[str], batch_tokens: int,
        steps: int, warmup: int, out_dir: str, profile: bool = False) -> list[dict]:
    for a in attentions:
        model_overrides(a)  # a bad label fails before any GPU work
    if not torch.cuda.is_available():
        raise UserError("nsa bench train needs a CUDA GPU")
    info = init_distributed("auto", 600.0, allow_single_process=True)
    finished = False
    try:
        meta = environment() | {"config": config or "defaults", "overrides": overrides,
                                "batch_tokens_per_rank": batch_tokens, "steps": steps, "warmup": warmup}
        name = f"train_{info.world_size}rank"
        rows, paths = [], ()
        for T in seq_lens:
            for a in attentions:
                # A row compiles the model and runs its steps (minutes at 32k): show it as it lands, and write the
                # results so far, so that a run cut short keeps every row it measured.
                with tf32_matmuls(info.device):  # as a training run multiplies
                    rows.append(measure(config, overrides, a, T, batch_tokens, steps, warmup, info,
                                        out_dir if profile else None))
                if info.is_main:
                    print_row(rows[-1], PROGRESS_COLUMNS)
                    paths = write_results(_with_ratios(rows), out_dir, name, meta)
        _with_ratios(rows)
        if info.is_main:
            print(f"\n{meta['device']}  torch {meta['torch']}  ranks {info.world_size}")
            print(format_table(rows, table_columns(rows)))
            paths += picture(rows, meta, Path(out_dir) / f"{name}.png")
            print("wrote " + ", ".join(map(str, paths)))
        finished = True
        return rows
    finally:
        shutdown(info, finished)
