"""Reading a run folder: metrics.csv, heartbeat_rank*.jsonl, nsa_stats.jsonl, env.json, config.yaml and
eval/eval.csv / eval/eval.json, for `nsa report`, `nsa compare` and anything else that looks at a run.

Only metrics.csv is required; the other files are empty when absent. Every reader tolerates a half-written
last line, because the trainer may be appending while the folder is read.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..errors import UserError
from ..storage import DamagedFile

BRANCH_NAMES = ("compressed", "selected", "window")
"""The branches in the order of the three values of gate_mean and gate_std in nsa_stats.jsonl."""


@dataclass
class RunData:
    """Everything read from a run folder; optional files are empty when absent."""

    run_dir: Path
    metrics: list[dict[str, float | None]]
    stats: list[dict[str, Any]]
    """nsa_stats.jsonl's records that hold per-layer entries, one per step (the latest wins)."""
    heartbeats: list[dict[str, Any]]
    config: dict[str, Any]
    env: dict[str, Any]
    has_stats_file: bool
    eval_rows: list[dict[str, Any]] = field(default_factory=list)
    """eval/eval.csv's well-formed rows (task, length, depth, samples, correct, accuracy)."""
    eval_summary: dict[str, Any] = field(default_factory=dict)
    """eval/eval.json, as `nsa eval` wrote it."""


def load_run(run_dir: Path) -> RunData:
    """Read a run folder; raises UserError when it is missing or has no metrics.csv."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder '{run_dir}' does not exist: give a folder such as runs/<name>")
    if not (run_dir / "metrics.csv").is_file():
        raise UserError(f"'{run_dir}' has no metrics.csv: give a run folder written by `nsa train` (runs/<name>)")
    stats_path = run_dir / "nsa_stats.jsonl"
    return RunData(
        run_dir=run_dir,
        metrics=read_metrics(run_dir / "metrics.csv"),
        stats=last_per_step([r for r in read_jsonl(stats_path) if isinstance(r.get("layers"), list)]),
        heartbeats=read_heartbeats(run_dir),
        config=read_mapping(run_dir / "config.yaml"),
        env=read_mapping(run_dir / "env.json"),
        has_stats_file=stats_path.is_file(),
        eval_rows=read_eval_rows(run_dir / "eval" / "eval.csv"),
        eval_summary=read_mapping(run_dir / "eval" / "eval.json"),
    )


def _complete_lines(path: Path) -> list[str]:
    # The trainer flushes whole lines, so a last line without its newline is still being written.
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if lines and not text.endswith(("\n", "\r")):
        lines.pop()
    return lines


def _number(cell: str | None) -> float | None:
    if cell is None or not cell.strip():
        return None
    try:
        return float(cell)
    except ValueError:
        return None


def read_metrics(path: Path) -> list[dict[str, float | None]]:
    """metrics.csv as numeric rows in step order; empty cells and missing columns read as None. Rows without a
    step are skipped with one warning; a file without a 'step' column is damaged."""
    reader = csv.DictReader(_complete_lines(path))
    if "step" not in (reader.fieldnames or []):
        raise DamagedFile(f"'{path}' is damaged: it has no 'step' column (a metrics.csv written by `nsa train` "
                          "starts with a header row); restore it, or resume the run to write it again")
    rows, skipped = [], 0
    for raw in reader:
        row = {key: _number(value) for key, value in raw.items() if isinstance(key, str)}
        if row.get("step") is not None:
            rows.append(row)
        else:
            skipped += 1
    _warn_skipped(path, skipped)
    return last_per_step(rows)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file. A half-written last line (a run still writing, or killed) is skipped
    quietly; other unreadable lines are skipped with one warning."""
    if not path.is_file():
        return []
    records, skipped = [], 0
    for line in _complete_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
    _warn_skipped(path, skipped)
    return records


def _warn_skipped(path: Path, skipped: int) -> None:
    if skipped:
        print(f"warning: {path}: skipped {skipped} unreadable line{'s' if skipped > 1 else ''}", file=sys.stderr)


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """All ranks' heartbeat events in time order; the rank comes from the file name if a record lacks it."""
    events = []
    for path in sorted(run_dir.glob("heartbeat_rank*.jsonl")):
        suffix = path.stem.removeprefix("heartbeat_rank")
        for record in read_jsonl(path):
            if not isinstance(record.get("time"), (int, float)):
                continue
            record.setdefault("rank", int(suffix) if suffix.isdigit() else suffix)
            events.append(record)
    return sorted(events, key=lambda r: r["time"])


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file's top-level mapping (JSON is YAML); {} when the file is missing, unreadable or holds
    something else: an optional file only removes a line from what is shown."""
    try:
        text = path.read_text(encoding="utf-8")
        value = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def read_eval_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an eval.csv that `nsa eval` wrote, typed; [] without the file. A malformed row is left out
    (it only removes a cell from a table)."""
    if not path.is_file():
        return []
    rows = []
    for raw in csv.DictReader(_complete_lines(path)):
        try:
            row = {"task": raw["task"], "length": int(raw["length"]), "depth": float(raw["depth"]),
                   "samples": int(raw["samples"]), "accuracy": float(raw["accuracy"])}
            # An eval.csv without a correct column gives the count its accuracy implies.
            correct = raw.get("correct")
            row["correct"] = int(correct) if correct else round(row["accuracy"] * row["samples"])
        except (KeyError, TypeError, ValueError):
            continue
        rows.append(row)
    return rows


def last_per_step(records: list[dict]) -> list[dict]:
    """Records in step order, one per step: a resumed run logs the steps after its checkpoint again, and the
    later record wins. Records without a finite step are left out."""
    by_step = {}
    for record in records:
        step = record.get("step")
        if isinstance(step, (int, float)) and math.isfinite(step):
            by_step[int(step)] = record
    return [by_step[s] for s in sorted(by_step)]


def column(rows: list[dict[str, float | None]], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, values) of the rows where `key` and `x` (default: the step) hold finite numbers."""
    pairs = [(r.get(x), r.get(key)) for r in rows]
    pairs = [(s, v) for s, v in pairs if v is not None and math.isfinite(v) and s is not None and math.isfinite(s)]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


# ------------------------------------------------------------------------------------------ NSA stats


@dataclass
class LayerSeries:
    """One layer's NSA statistics over the logged steps (arrays aligned with `steps`)."""

    layer: int
    steps: np.ndarray
    gate_mean: np.ndarray
    """[n, 3] in BRANCH_NAMES order."""
    gate_std: np.ndarray
    """[n, 3]."""
    entropy: np.ndarray
    """[n], nan where not logged."""
    sel_distance_mean: np.ndarray
    sel_forced_share: np.ndarray
    gate_head_min: np.ndarray
    """[n, 3]: the lowest head's gate averaged over the tokens, per branch; nan where not logged."""
    sel_kl: np.ndarray
    """[n]: the selection KL (nsa.telemetry.health), nan where not logged."""


def layer_series(stats: list[dict[str, Any]]) -> list[LayerSeries]:
    """Per-layer time series from nsa_stats records; layer entries without three gate means are skipped."""
    collected: dict[int, list[tuple]] = {}
    for record in stats:
        for i, entry in enumerate(record["layers"]):
            if not isinstance(entry, dict) or not _three_numbers(entry.get("gate_mean")):
                continue
            std = entry.get("gate_std") if _three_numbers(entry.get("gate_std")) else [0.0, 0.0, 0.0]
            head_min = entry.get("gate_head_min") if _three_numbers(entry.get("gate_head_min")) else [math.nan] * 3
            layer = entry.get("layer", i)
            collected.setdefault(int(layer), []).append((
                record["step"], entry["gate_mean"], std, _float(entry.get("gate_entropy")),
                _float(entry.get("sel_distance_mean")), _float(entry.get("sel_forced_share")), head_min,
                _float(entry.get("sel_kl")),
            ))
    series = []
    for layer in sorted(collected):
        steps, mean, std, entropy, distance, forced, head_min, kl = zip(*collected[layer])
        series.append(LayerSeries(layer, np.asarray(steps, float), np.asarray(mean, float), np.asarray(std, float),
                                  np.asarray(entropy), np.asarray(distance), np.asarray(forced),
                                  np.asarray(head_min, float), np.asarray(kl, float)))
    return series


def _three_numbers(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 3 and all(isinstance(x, (int, float)) for x in value)


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def distance_histogram(stats: list[dict[str, Any]]) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(step, edges, counts summed over layers) of the latest record that has a well-formed histogram."""
    for record in reversed(stats):
        edges, per_layer = record.get("distance_edges"), record.get("distance_counts")
        if not isinstance(edges, list) or len(edges) < 2 or not isinstance(per_layer, list):
            continue
        rows = [c for c in per_layer if isinstance(c, list) and len(c) == len(edges) - 1]
        if rows:
            return int(record["step"]), np.asarray(edges, float), np.asarray(rows, float).sum(axis=0)
    return None
