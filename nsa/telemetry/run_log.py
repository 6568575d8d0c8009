"""Everything a run writes about itself, in one place.

Rank 0: metrics.csv, nsa_stats.jsonl, env.json and the scalars, to TensorBoard (tb/) and, with telemetry.wandb,
to Weights & Biases under the same names and steps. Every rank: heartbeat_rank{r}.jsonl. On resume, rows logged after the checkpoint's step are dropped, so the
files continue exactly where the checkpoint left off. Rows are written by a background thread
(TensorBoard has its own), never by the training thread.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from .async_writer import AsyncWriter
from .environment import run_environment
from .heartbeat import Heartbeat
from .metrics import MetricsCSV
from .wandb_run import WandbRun

METRIC_FIELDS = ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "mem_gb",
                 "data_wait", "seq_len"]
"""metrics.csv columns: mem_gb is the peak GPU memory allocated since the previous row (reserved, under
parallel.cudagraphs: see nsa.train.loop.peak_memory_gb); data_wait is the share of the time since the previous row
that the training thread spent waiting for batches; seq_len is the tokens per row of the logged step's batch (with
data.retrieval.mix_lengths it varies by step; empty when the step's micro-batches differed), last so that the
older columns keep their places."""

STEP_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mem_gb", "data_wait")
"""metrics.csv columns also written as scalars, as train/<column>."""


def step_scalars(row: dict) -> dict[str, float]:
    """{'train/loss': ..., ...}: a metrics row's scalars, without the ones it lacks (mem_gb on a CPU)."""
    return {f"train/{key}": row[key] for key in STEP_SCALARS if row.get(key) is not None}


def health_scalars(record: dict) -> dict[str, float]:
    """{'gates/layer0_cmp': ..., 'selection/layer0_distance': ...}: a health record's per-layer scalars."""
    scalars = {}
    for layer in record["layers"]:
        i = layer["layer"]
        for branch, g in zip(("cmp", "sel", "win"), layer["gate_mean"]):
            scalars[f"gates/layer{i}_{branch}"] = g
        scalars[f"selection/layer{i}_distance"] = layer["sel_distance_mean"]
    return scalars


class RunLog:
    def __init__(self, run_dir: Path, rank: int, is_main: bool, config: dict, world_size: int, resumed_step: int,
                 tensorboard: bool, wandb: dict | None = None):
        """`wandb`: WandbRun's project, name and mode, or None to leave W&B out."""
        self.run_dir, self.is_main = run_dir, is_main
        self.writer = AsyncWriter(f"run-log-rank{rank}")
        self.heartbeat = Heartbeat(run_dir / f"heartbeat_rank{rank}.jsonl", rank, self.writer)
        self.metrics = self.stats = self.tb = self.wandb = None
        if not is_main:
            return
        with open(run_dir / "env.json", "w", encoding="utf-8") as f:
            json.dump(run_environment(config, world_size), f, indent=1, default=str)
        self.metrics = _continue_csv(run_dir / "metrics.csv", resumed_step)
        self.stats = _continue_jsonl(run_dir / "nsa_stats.jsonl", resumed_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # its own thread writes the event file

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        if wandb is not None:
            self.wandb = WandbRun(run_dir, config, **wandb)

    def event(self, name: str, step: int, **fields) -> None:
        self.heartbeat.event(name, step, **fields)

    def step(self, row: dict, local: dict) -> None:
        """A logging step: the global row (rank 0 files) and this rank's own numbers (heartbeat)."""
        self.heartbeat.event("step", row["step"], loss=row["loss"], **local)
        if self.metrics:
            self.writer.submit(lambda: self.metrics.write(row), self.run_dir / "metrics.csv")
        self._scalars(step_scalars(row), row["step"])

    def evaluation(self, step: int, val_loss: float) -> None:
        self.heartbeat.event("eval", step, val_loss=val_loss)
        self._scalars({"val/loss": val_loss}, step)

    def health(self, step: int, record: dict) -> None:
        if self.stats:
            line = json.dumps({"step": step, **record}) + "\n"
            self.writer.submit(lambda: (self.stats.write(line), self.stats.flush()), self.run_dir / "nsa_stats.jsonl")
        self._scalars(health_scalars(record), step)

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        """The same scalars, under the same names and step, to every scalar sink that is on."""
        if self.tb:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log(scalars, step)

    @property
    def failure(self) -> tuple[Path | str, OSError] | None:
        """(the file, the error) of the first run-file write that failed on this rank, or None."""
        return self.writer.failure

    def close(self) -> None:
        """Write everything still queued and close the files (safe to call twice)."""
        self.heartbeat.close()
        for f in (self.metrics, self.stats):
            if f is not None:
                self.writer.submit(f.close)
        self.writer.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def _continue_csv(path: Path, resumed_step: int) -> MetricsCSV:
    kept = []
    if resumed_step > 0 and path.exists():
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            kept = [r for r in csv.DictReader(f) if (r.get("step") or "").isdigit() and int(r["step"]) <= resumed_step]
    return MetricsCSV(path, METRIC_FIELDS, kept)


def _continue_jsonl(path: Path, resumed_step: int):
    """nsa_stats.jsonl with the records up to resumed_step kept (rewritten through a new file, so a failed
    rewrite loses nothing), open for appending."""
    kept = []
    if resumed_step > 0 and path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return open(path, "a", encoding="utf-8")
