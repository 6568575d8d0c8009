"""`nsa report`: PNG plots and a markdown summary from a run folder, finished or still running.

Only metrics.csv is required; nsa_stats.jsonl, heartbeat_rank*.jsonl, env.json and config.yaml add
sections when present. Every reader tolerates a half-written last line, because the trainer may be
appending while the report is drawn.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..errors import UserError
from ..storage import DamagedFile

BRANCHES = ("compressed", "selected", "window")
BRANCH_COLORS = ("tab:blue", "tab:orange", "tab:green")
COLLAPSE_LOW, COLLAPSE_HIGH = 0.02, 0.98
FLAT_MOVE = 1e-3
MAX_ENTROPY = math.log(3)
NOTABLE_EVENTS = ("stall", "halt", "warning")
# Every image the report may write; images of a previous report that this one skips are removed,
# so the folder never mixes two renderings.
REPORT_IMAGES = ("loss.png", "throughput.png", "lr.png", "memory.png", "gates.png", "selection.png")


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class RunData:
    """Everything read from a run folder; optional files are empty when absent."""

    run_dir: Path
    metrics: list[dict[str, float | None]]
    stats: list[dict[str, Any]]
    heartbeats: list[dict[str, Any]]
    config: dict[str, Any]
    env: dict[str, Any]
    has_stats_file: bool


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
        stats=_last_per_step([r for r in read_jsonl(stats_path) if isinstance(r.get("layers"), list)]),
        heartbeats=read_heartbeats(run_dir),
        config=_read_mapping(run_dir / "config.yaml", yaml.safe_load),
        env=_read_mapping(run_dir / "env.json", json.loads),
        has_stats_file=stats_path.is_file(),
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
    return _last_per_step(rows)


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


def _read_mapping(path: Path, parse) -> dict[str, Any]:
    # Optional files: a missing or unreadable one only removes a line from the report.
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def _last_per_step(records: list[dict]) -> list[dict]:
    # A resumed run logs the steps after its checkpoint again: the later record wins.
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
    gate_mean: np.ndarray  # [n, 3]: compressed, selected, window
    gate_std: np.ndarray  # [n, 3]
    entropy: np.ndarray  # [n], nan where not logged
    sel_distance_mean: np.ndarray
    sel_forced_share: np.ndarray


def layer_series(stats: list[dict[str, Any]]) -> list[LayerSeries]:
    """Per-layer time series from nsa_stats records; layer entries without three gate means are skipped."""
    collected: dict[int, list[tuple]] = {}
    for record in stats:
        for i, entry in enumerate(record["layers"]):
            if not isinstance(entry, dict) or not _triple(entry.get("gate_mean")):
                continue
            std = entry.get("gate_std") if _triple(entry.get("gate_std")) else [0.0, 0.0, 0.0]
            layer = entry.get("layer", i)
            collected.setdefault(int(layer), []).append((
                record["step"], entry["gate_mean"], std, _float(entry.get("gate_entropy")),
                _float(entry.get("sel_distance_mean")), _float(entry.get("sel_forced_share")),
            ))
    series = []
    for layer in sorted(collected):
        steps, mean, std, entropy, distance, forced = zip(*collected[layer])
        series.append(LayerSeries(layer, np.asarray(steps, float), np.asarray(mean, float), np.asarray(std, float),
                                  np.asarray(entropy), np.asarray(distance), np.asarray(forced)))
    return series


def _triple(value: Any) -> bool:
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


def gate_warnings(series: list[LayerSeries]) -> list[str]:
    """A line per collapsed gate (final mean < 0.02 or > 0.98) and per layer whose gates never moved."""
    warnings = []
    for s in series:
        final = s.gate_mean[-1]
        for name, value in zip(BRANCHES, final):
            if value < COLLAPSE_LOW or value > COLLAPSE_HIGH:
                bound = f"< {COLLAPSE_LOW}" if value < COLLAPSE_LOW else f"> {COLLAPSE_HIGH}"
                warnings.append(f"layer {s.layer}: {name} gate collapsed (mean {value:.4f} {bound})")
        # One record cannot show movement; a flat layer needs at least two distinct steps.
        if len(s.steps) >= 2:
            moved = float((s.gate_mean.max(axis=0) - s.gate_mean.min(axis=0)).max())
            if moved < FLAT_MOVE:
                warnings.append(f"layer {s.layer}: gate means flat (moved {moved:.1e} < {FLAT_MOVE:g} "
                                f"over steps {int(s.steps[0])}-{int(s.steps[-1])}): are the gates training?")
    return warnings


# ----------------------------------------------------------------------------------------- heartbeats


def notable_events(heartbeats: list[dict[str, Any]]) -> list[str]:
    """Distinct stall/halt/warning events (same type and message merged), with their ranks and steps."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in heartbeats:
        if record.get("event") in NOTABLE_EVENTS:
            groups.setdefault((record["event"], str(record.get("message", "")).strip()), []).append(record)
    lines = []
    for (event, message), records in groups.items():
        ranks = sorted({str(r.get("rank", "?")) for r in records})
        steps = sorted({r["step"] for r in records if isinstance(r.get("step"), int)})
        where = f"rank {', '.join(ranks)}" + (f", step {_span(steps)}" if steps else "")
        times = f" ({len(records)}x)" if len(records) > 1 else ""
        lines.append(f"**{event}** ({where}){times}: {message or '(no message)'}")
    return lines


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def stale_ranks(heartbeats: list[dict[str, Any]], min_lag_s: float = 60.0, factor: float = 5.0
                ) -> list[tuple[Any, float]]:
    """(rank, seconds behind the newest rank) for ranks that went quiet while others kept beating.

    "Much older" is relative to the heartbeat rhythm: `factor` times the median interval between
    a rank's heartbeats, but never less than `min_lag_s`. A rank whose last event is "done" is not stale.
    """
    last: dict[Any, dict] = {}
    gaps: list[float] = []
    for record in heartbeats:
        rank = record.get("rank")
        if rank in last:
            gaps.append(record["time"] - last[rank]["time"])
        last[rank] = record
    if len(last) < 2:
        return []
    newest = max(r["time"] for r in last.values())
    threshold = max(min_lag_s, factor * statistics.median(gaps)) if gaps else min_lag_s
    return [(rank, newest - r["time"]) for rank, r in sorted(last.items(), key=lambda kv: str(kv[0]))
            if r.get("event") != "done" and newest - r["time"] > threshold]


# ---------------------------------------------------------------------------------------------- plots


def new_figure(width: float, height: float):
    """A matplotlib Figure of the given size in inches (also used by `nsa eval` and `nsa compare`)."""
    # A bare Figure renders PNGs through Agg without pyplot: no global backend switch and no figure registry
    # to leak, so the report is safe to call from a notebook or a training process.
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("the plots need matplotlib: pip install matplotlib") from None
    return Figure(figsize=(width, height), layout="constrained", dpi=110)


def save_png(fig, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _span_log(values: np.ndarray) -> bool:
    positive = values[values > 0]
    return positive.size > 0 and positive.size == values.size and positive.max() > 10 * positive.min()


def plot_loss(rows: list[dict], path: Path) -> Path | None:
    steps, loss = column(rows, "loss")
    vsteps, vloss = column(rows, "val_loss")
    if not steps.size and not vsteps.size:
        return None
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(steps, loss, lw=1.2, label="train loss")
    if vsteps.size:
        ax.plot(vsteps, vloss, "o", ms=5, color="tab:red", label="validation loss")
    if _span_log(np.concatenate([loss, vloss])):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return save_png(fig, path)


def plot_throughput(rows: list[dict], path: Path) -> Path | None:
    steps, tps = column(rows, "tokens_per_s")
    wsteps, wait = column(rows, "data_wait")
    if not steps.size:
        return None
    fig = new_figure(7, 5.5 if wsteps.size else 4)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1]) if wsteps.size else [fig.add_subplot()]
    axes[0].plot(steps, tps, lw=1.2)
    axes[0].set(ylabel="tokens/s", title="throughput")
    axes[0].grid(alpha=0.3)
    if wsteps.size:
        axes[1].plot(wsteps, 100 * wait, lw=1.2, color="tab:red")
        axes[1].set(ylabel="data wait (% of step)", ylim=(0, max(5.0, 100 * float(wait.max()) * 1.1)))
        axes[1].grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return save_png(fig, path)


def plot_single(rows: list[dict], key: str, ylabel: str, title: str, path: Path) -> Path | None:
    steps, values = column(rows, key)
    if not steps.size:
        return None
    fig = new_figure(7, 3.5)
    ax = fig.add_subplot()
    ax.plot(steps, values, lw=1.2)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return save_png(fig, path)


def plot_gates(series: list[LayerSeries], path: Path) -> Path | None:
    if not series:
        return None
    ncols = min(4, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig = new_figure(3.2 * ncols, 2.4 * nrows + 0.4)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)).ravel()
    for ax, s in zip(axes, series):
        for b, (name, color) in enumerate(zip(BRANCHES, BRANCH_COLORS)):
            mean, std = s.gate_mean[:, b], s.gate_std[:, b]
            ax.plot(s.steps, mean, color=color, lw=1.2, label=name)
            ax.fill_between(s.steps, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1), color=color, alpha=0.2)
        ax.set_title(f"layer {s.layer}", fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in axes[len(series):]:
        ax.set_axis_off()
    # One legend for the grid, outside the panels, so it never hides a collapsed gate's line.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper right", ncols=3, fontsize=8)
    fig.suptitle("gate mean per branch (band: +-std)")
    fig.supxlabel("step")
    return save_png(fig, path)


def plot_selection(stats: list[dict[str, Any]], series: list[LayerSeries], path: Path) -> Path | None:
    histogram = distance_histogram(stats)
    has_series = any(np.isfinite(s.sel_distance_mean).any() or np.isfinite(s.sel_forced_share).any()
                     for s in series)
    if histogram is None and not has_series:
        return None
    fig = new_figure(10, 7.5 if histogram is not None and has_series else 4)
    grid = fig.add_gridspec(2 if histogram is not None and has_series else 1, 2)
    row = 0
    if histogram is not None:
        _draw_histogram(fig.add_subplot(grid[row, :]), *histogram)
        row += 1
    if has_series:
        colors = _layer_colors(len(series))
        ax_d, ax_f = fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])
        for s, color in zip(series, colors):
            ax_d.plot(s.steps, s.sel_distance_mean, color=color, lw=1, label=f"layer {s.layer}")
            ax_f.plot(s.steps, s.sel_forced_share, color=color, lw=1, label=f"layer {s.layer}")
        ax_d.set(xlabel="step", ylabel="tokens", title="mean distance to selected blocks")
        ax_f.set(xlabel="step", ylabel="share", title="share of selected blocks that are forced", ylim=(0, 1))
        for ax in (ax_d, ax_f):
            ax.grid(alpha=0.3)
        if len(series) <= 12:
            ax_f.legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
    return save_png(fig, path)


def _draw_histogram(ax, step: int, edges: np.ndarray, counts: np.ndarray) -> None:
    edges = edges.copy()
    if edges[0] <= 0 < edges[1]:
        edges[0] = edges[1] / 2  # a log axis cannot show 0; the first bin still starts left of edge 1
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", edgecolor="white", linewidth=0.5)
    if (edges > 0).all():
        ax.set_xscale("log")
    ax.set(xlabel="query-to-block distance (tokens)", ylabel="chosen blocks (all layers)",
           title=f"selection distance, step {step}")
    ax.grid(alpha=0.3, axis="y")


def _layer_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.9) for i in range(n)]


# ---------------------------------------------------------------------------------------------- report


def render_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the plots and report.md for `run_dir` into `out_dir` (default: run_dir/report); returns report.md."""
    run = load_run(Path(run_dir))
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    series = layer_series(run.stats)
    rows = run.metrics
    plots = {
        "loss.png": lambda p: plot_loss(rows, p),
        "throughput.png": lambda p: plot_throughput(rows, p),
        "lr.png": lambda p: plot_single(rows, "lr", "learning rate", "learning rate", p),
        "memory.png": lambda p: plot_single(rows, "mem_gb", "GB", "memory (mem_gb)", p),
        "gates.png": lambda p: plot_gates(series, p),
        "selection.png": lambda p: plot_selection(run.stats, series, p),
    }
    written = []
    for name in REPORT_IMAGES:
        path = out / name
        if plots[name](path) is not None:
            written.append(name)
        elif path.exists():
            path.unlink()
    report = out / "report.md"
    report.write_text(summary_markdown(run, series, written), encoding="utf-8")
    return report


def summary_markdown(run: RunData, series: list[LayerSeries], images: list[str]) -> str:
    """The text of report.md."""
    parts = [f"# Run report: {run.run_dir.resolve().name}", "", _status_line(run), ""]
    parts += ["## Summary", "", "| | |", "|---|---|"]
    parts += [f"| {key} | {value} |" for key, value in summary_rows(run)]
    parts += ["", "## Health", ""]
    parts += _gate_section(run, series)
    parts += _heartbeat_section(run.heartbeats)
    parts += ["## Plots", ""]
    parts += [f"![]({name})\n" for name in images]
    skipped = _skipped_images(run, images)
    if skipped:
        parts += ["Not drawn:", ""] + [f"- {line}" for line in skipped] + [""]
    return "\n".join(parts).rstrip() + "\n"


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, value) pairs of the summary table."""
    rows = run.metrics
    if not rows:
        return [("steps", "no metrics rows logged yet")]
    last = rows[-1]
    total = _get(run.config, "train", "steps")
    steps = f"{int(last['step']):,}"
    if isinstance(total, int) and total > 0:
        steps += f" / {total:,} ({100 * last['step'] / total:.0f}%)"
    out = [("steps", steps)]
    if last.get("tokens") is not None:
        out.append(("tokens seen", human_count(last["tokens"])))
    lsteps, loss = column(rows, "loss")
    if loss.size:
        out.append(("last train loss", f"{loss[-1]:.4f} (step {int(lsteps[-1])})"))
    vsteps, vloss = column(rows, "val_loss")
    if vloss.size:
        best = int(np.argmin(vloss))
        out.append(("best val loss", f"{vloss[best]:.4f} (step {int(vsteps[best])})"))
    half = rows[len(rows) // 2:]  # the second half of the logged rows: past warm-up and compilation
    _, tps = column(half, "tokens_per_s")
    if tps.size:
        out.append(("tokens/s (median, last half)", f"{float(np.median(tps)):,.0f}"))
    _, wait = column(half, "data_wait")
    if wait.size:
        out.append(("data wait (median, last half)", f"{100 * float(np.median(wait)):.1f}% of step time"))
    _, mem = column(rows, "mem_gb")
    out.append(("peak memory", f"{float(mem.max()):.2f} GB" if mem.size else "not logged"))
    if last.get("elapsed_s") is not None:
        out.append(("elapsed", _duration(last["elapsed_s"])))
    env = _env_line(run.env)
    if env:
        out.append(("environment", env))
    return out


def _status_line(run: RunData) -> str:
    where = f"Run folder `{run.run_dir}`; report written {_utc(time.time())}."
    if not run.heartbeats:
        return where
    last = run.heartbeats[-1]
    # Only the newest event counts: a time-sliced launch may end with "done" and be resumed later.
    if last.get("event") == "done":
        return f"{where} Status: finished (last heartbeat {_utc(last['time'])})."
    age = time.time() - last["time"]
    return (f"{where} Status: not finished: last heartbeat '{last.get('event', '?')}' at step "
            f"{last.get('step', '?')}, {_utc(last['time'])} ({_duration(age)} ago).")


def _gate_section(run: RunData, series: list[LayerSeries]) -> list[str]:
    if not run.has_stats_file:
        return ["### Gates", "", "No nsa_stats.jsonl: a dense model (or an older trainer), so no gate or selection "
                "statistics.", ""]
    if not series:
        return ["### Gates", "", "nsa_stats.jsonl has no complete record yet.", ""]
    step = max(int(s.steps[-1]) for s in series)
    lines = ["### Gates", "",
             f"Gates at the last record (step {step}); entropy in nats, at most ln 3 = {MAX_ENTROPY:.3f}:", "",
             "| layer | compressed | selected | window | entropy | forced share |",
             "|---|---|---|---|---|---|"]
    for s in series:
        cmp_, sel, win = s.gate_mean[-1]
        lines.append(f"| {s.layer} | {cmp_:.3f} | {sel:.3f} | {win:.3f} | {_maybe(s.entropy[-1])} "
                     f"| {_maybe(s.sel_forced_share[-1])} |")
    warnings = gate_warnings(series)
    lines += ["", "Gate warnings:" if warnings else "Gate warnings: none.", ""]
    if warnings:
        lines += [f"- {w}" for w in warnings] + [""]
    return lines


def _heartbeat_section(heartbeats: list[dict[str, Any]]) -> list[str]:
    if not heartbeats:
        return ["### Ranks", "", "No heartbeat files.", ""]
    last: dict[Any, dict] = {}
    for record in heartbeats:
        last[record.get("rank")] = record
    newest = max(r["time"] for r in last.values())
    lines = ["### Ranks", "", "| rank | last event | step | behind the newest rank |", "|---|---|---|---|"]
    for rank, r in sorted(last.items(), key=lambda kv: str(kv[0])):
        lines.append(f"| {rank} | {r.get('event', '?')} | {r.get('step', '?')} | {_duration(newest - r['time'])} |")
    events = notable_events(heartbeats)
    lines += ["", "Stall, halt and warning events:" if events else "Stall, halt and warning events: none.", ""]
    if events:
        lines += [f"- {e}" for e in events] + [""]
    stale = stale_ranks(heartbeats)
    if stale:
        lines += ["Stale ranks:", ""]
        lines += [f"- rank {rank} is stale: its last heartbeat is {_duration(lag)} older than the newest rank's"
                  for rank, lag in stale] + [""]
    return lines


def _skipped_images(run: RunData, images: list[str]) -> list[str]:
    reasons = {
        "loss.png": "loss.png: no loss values logged yet",
        "throughput.png": "throughput.png: no tokens_per_s values logged",
        "lr.png": "lr.png: no lr values logged",
        "memory.png": "memory.png: no mem_gb values (a CPU run, or a trainer that did not log memory)",
    }
    if run.has_stats_file:
        reasons["gates.png"] = "gates.png: no complete nsa_stats.jsonl record"
        reasons["selection.png"] = "selection.png: no selection statistics in nsa_stats.jsonl"
    return [reason for name, reason in reasons.items() if name not in images]


# ------------------------------------------------------------------------------------------ formatting


def _get(mapping: dict, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _env_line(env: dict[str, Any]) -> str:
    parts = []
    gpus = env.get("gpus")
    if isinstance(gpus, list) and gpus:
        first = gpus[0].get("name", "?") if isinstance(gpus[0], dict) else str(gpus[0])
        parts.append(f"{len(gpus)}x {first}")
    versions = env.get("versions")
    if isinstance(versions, dict) and versions.get("torch"):
        parts.append(f"torch {versions['torch']}")
    if isinstance(env.get("git"), str) and env["git"]:
        parts.append(f"git {env['git']}")
    return ", ".join(parts)


def human_count(n: float) -> str:
    """1234567 -> '1.23M' (k, M, B, T)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _maybe(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
