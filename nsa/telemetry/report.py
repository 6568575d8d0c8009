"""`nsa report`: PNG plots and a markdown summary from a run folder, finished or still running.

Only metrics.csv is required; nsa_stats.jsonl, heartbeat_rank*.jsonl, env.json and config.yaml add
sections when present (nsa.telemetry.run_files reads them, nsa.plots.run and nsa.plots.gates draw).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..plots.gates import plot_gates_over_steps
from ..plots.run import plot_loss, plot_metric, plot_selection, plot_throughput
from .run_files import BRANCH_NAMES, LayerSeries, RunData, column, layer_series, load_run

COLLAPSE_LOW, COLLAPSE_HIGH = 0.02, 0.98
FLAT_MOVE = 1e-3
UNMOVED_MEAN, UNMOVED_ENTROPY, UNMOVED_RECORDS = 0.05, 0.1, 10
"""A layer's gates count as where they started when, after at least UNMOVED_RECORDS records, every branch's mean
lies within UNMOVED_MEAN of the first record's and the entropy within UNMOVED_ENTROPY nats of it: gates that
trained and came back, or that the loss never pulled, as in a layer the task does not use."""
MAX_ENTROPY = math.log(3)
NOTABLE_EVENTS = ("stall", "halt", "warning")
# Every image the report may write; images of a previous report that this one skips are removed,
# so the folder never mixes two renderings.
REPORT_IMAGES = ("loss.png", "throughput.png", "lr.png", "memory.png", "gates.png", "selection.png")


# ------------------------------------------------------------------------------------------ NSA stats


def gate_warnings(series: list[LayerSeries]) -> list[str]:
    """A line per collapsed gate (final mean < 0.02 or > 0.98) and per layer whose gates never moved."""
    warnings, flat = [], set()
    for s in series:
        final = s.gate_mean[-1]
        for name, value in zip(BRANCH_NAMES, final):
            if value < COLLAPSE_LOW or value > COLLAPSE_HIGH:
                bound = f"< {COLLAPSE_LOW}" if value < COLLAPSE_LOW else f"> {COLLAPSE_HIGH}"
                warnings.append(f"layer {s.layer}: {name} gate collapsed (mean {value:.4f} {bound})")
        # One record cannot show movement; a flat layer needs at least two distinct steps.
        if len(s.steps) >= 2:
            moved = float((s.gate_mean.max(axis=0) - s.gate_mean.min(axis=0)).max())
            if moved < FLAT_MOVE:
                flat.add(s.layer)
                warnings.append(f"layer {s.layer}: gate means flat (moved {moved:.1e} < {FLAT_MOVE:g} "
                                f"over steps {int(s.steps[0])}-{int(s.steps[-1])}): are the gates training?")
    unmoved = [s for s in unmoved_layers(series) if s.layer not in flat]
    if unmoved:
        names = ", ".join(str(s.layer) for s in unmoved)
        warnings.append(f"layer{'s' if len(unmoved) > 1 else ''} {names}: gates where they started (every branch's "
                        f"mean within {UNMOVED_MEAN} of step {int(unmoved[0].steps[0])}'s, entropy within "
                        f"{UNMOVED_ENTROPY} nats) at step {int(unmoved[0].steps[-1])}: does the task use "
                        f"{'them' if len(unmoved) > 1 else 'it'}? (nsa eval --ablate-attention {names.replace(' ', '')})")
    return warnings


def unmoved_layers(series: list[LayerSeries]) -> list[LayerSeries]:
    """The layers whose last record's gates are where their first record's were (UNMOVED_MEAN, UNMOVED_ENTROPY),
    once they have at least UNMOVED_RECORDS records."""
    unmoved = []
    for s in series:
        if len(s.steps) < UNMOVED_RECORDS:
            continue
        mean_moved = float(np.abs(s.gate_mean[-1] - s.gate_mean[0]).max())
        entropy_moved = abs(float(s.entropy[-1] - s.entropy[0]))  # nan (not logged) compares False below
        if mean_moved < UNMOVED_MEAN and not entropy_moved >= UNMOVED_ENTROPY:
            unmoved.append(s)
    return unmoved


@dataclass(frozen=True)
class CollapseSpan:
    """Consecutive health records in which a layer's gate stayed collapsed."""

    layer: int
    what: str
    """A branch name, or ATTENTION_OFF: every branch below COLLAPSE_LOW at once (the layer's attention off)."""
    start: int
    end: int
    """Steps of the first and the last record of the span."""

    @property
    def steps(self) -> int:
        return self.end - self.start


ATTENTION_OFF = "attention off"


def collapse_spans(series: list[LayerSeries]) -> list[CollapseSpan]:
    """Every span of records in which a branch's gate mean lay below COLLAPSE_LOW or above COLLAPSE_HIGH, or all
    three below COLLAPSE_LOW (ATTENTION_OFF), per layer in record order: how long a collapse lasted, not only
    whether the last record shows one."""
    spans = []
    for s in series:
        low, high = s.gate_mean < COLLAPSE_LOW, s.gate_mean > COLLAPSE_HIGH  # [records, 3]
        flags = {name: low[:, i] | high[:, i] for i, name in enumerate(BRANCH_NAMES)} | {ATTENTION_OFF: low.all(1)}
        for what, flag in flags.items():
            start = None
            for i, collapsed in enumerate([*flag.tolist(), False]):
                if collapsed and start is None:
                    start = i
                elif not collapsed and start is not None:
                    spans.append(CollapseSpan(s.layer, what, int(s.steps[start]), int(s.steps[i - 1])))
                    start = None
    return spans


def lowest_head_gate(series: list[LayerSeries]) -> tuple[float, int, int, str, int, int] | None:
    """(value, step, layer, branch) of the lowest per-head gate mean over every record and layer, then how many of
    the logged steps had some head of some layer below COLLAPSE_LOW, and of how many; None where no record has
    per-head means (an older trainer's)."""
    logged = [s for s in series if not np.isnan(s.gate_head_min).all()]
    if not logged:
        return None
    value, step, layer, branch = min(
        (float(v), int(s.steps[i]), s.layer, BRANCH_NAMES[c])
        for s in logged for (i, c), v in np.ndenumerate(s.gate_head_min) if not np.isnan(v))
    steps = {int(t) for s in logged for t in s.steps}
    below = {int(s.steps[i]) for s in logged for i in np.flatnonzero((s.gate_head_min < COLLAPSE_LOW).any(1))}
    return value, step, layer, branch, len(below), len(steps)


def describe_lowest_head(lowest: tuple[float, int, int, str, int, int]) -> str:
    """lowest_head_gate's result as one sentence."""
    value, step, layer, branch, below, records = lowest
    return (f"Lowest head's gate (one head's gate averaged over the tokens, what model.nsa.gate_floor acts on): "
            f"{value:.4f} at step {step:,} (layer {layer}, {branch}); records with a head under {COLLAPSE_LOW}: "
            f"{below} of {records}.")


def longest_collapse(spans: list[CollapseSpan], what: str | None = None) -> CollapseSpan | None:
    """The longest span (of `what` only, if given; ATTENTION_OFF or a branch), None without one."""
    chosen = [span for span in spans if what is None or span.what == what]
    return max(chosen, key=lambda span: span.steps, default=None)


def describe_span(span: CollapseSpan | None) -> str:
    """'layer 2, window, steps 1,100-3,300 (2,200 steps)', or 'none'."""
    if span is None:
        return "none"
    return f"layer {span.layer}, {span.what}, steps {span.start:,}-{span.end:,} ({span.steps:,} steps)"


# ------------------------------------------------------------------------------------ loss by length

MISSED_LOSS = 0.05
"""A logged step whose loss exceeds this many nats counts as missed: under answer-only retrieval loss
(data.retrieval.loss=answer) a solved example costs ~1e-3 nats and a missed one ~1-2, so 0.05 lies far from both."""


@dataclass(frozen=True)
class LengthLoss:
    """The logged steps of one sequence length."""

    seq_len: int
    steps: int
    missed: float
    """Share of the steps whose loss exceeded MISSED_LOSS."""
    median: float


def with_length(rows: list[dict[str, float | None]]) -> list[dict[str, float | None]]:
    """The rows with a finite loss and seq_len: not an older trainer's (no seq_len column), nor a step whose
    micro-batches differed in length."""
    return [r for r in rows if all(r.get(key) is not None and math.isfinite(r[key]) for key in ("loss", "seq_len"))]


def loss_by_length(rows: list[dict[str, float | None]]) -> list[LengthLoss]:
    """Per seq_len in rising order: the logged steps, the share of them above MISSED_LOSS and their median loss
    (each row's loss is its own step's, so a length's steps tell how that length fares)."""
    by_length: dict[int, list[float]] = {}
    for row in with_length(rows):
        by_length.setdefault(int(row["seq_len"]), []).append(row["loss"])
    return [LengthLoss(length, len(losses), sum(x > MISSED_LOSS for x in losses) / len(losses),
                       statistics.median(losses)) for length, losses in sorted(by_length.items())]


def last_third(rows: list) -> list:
    """The last third of the rows (at least one of a non-empty list): where a run stands in its last stage."""
    return rows[(2 * len(rows)) // 3:]


@dataclass(frozen=True)
class LengthTable:
    """loss_by_length over the last third of the rows with a length (steps first to last) and over the run."""

    first: int
    last: int
    tail: dict[int, LengthLoss]
    run: list[LengthLoss]


def length_table(rows: list[dict[str, float | None]]) -> LengthTable | None:
    """The table of a run whose steps had more than one sequence length; None otherwise (one length says nothing
    the loss curve does not)."""
    known = with_length(rows)
    run = loss_by_length(known)
    if len(run) < 2:
        return None
    tail = last_third(known)
    return LengthTable(int(tail[0]["step"]), int(tail[-1]["step"]), {s.seq_len: s for s in loss_by_length(tail)}, run)


LENGTH_COLUMNS = ["length", "steps (end)", f"loss > {MISSED_LOSS:g} (end)", "median (end)", "steps (all)",
                  f"loss > {MISSED_LOSS:g} (all)", "median (all)"]


def length_cells(table: LengthTable) -> list[dict[str, str]]:
    """The table's rows as text under LENGTH_COLUMNS, shared by report.md and the printed table; '-' where a
    length has no step in the last third."""
    rows = []
    for whole in table.run:
        row = {"length": f"{whole.seq_len:,}"}
        for part, stats in (("end", table.tail.get(whole.seq_len)), ("all", whole)):
            row[f"steps ({part})"] = str(stats.steps) if stats else "0"
            row[f"loss > {MISSED_LOSS:g} ({part})"] = f"{100 * stats.missed:.0f}%" if stats else "-"
            row[f"median ({part})"] = f"{stats.median:.3g}" if stats else "-"
        rows.append(row)
    return rows


def describe_length_table(table: LengthTable) -> str:
    """What the table's columns hold, in one sentence."""
    return (f"Each logged step's own training loss by its batch's sequence length (metrics.csv's seq_len); end: the "
            f"last third of the logged steps (steps {table.first:,}-{table.last:,}), all: the whole run; "
            f"loss > {MISSED_LOSS:g}: the share of those steps whose loss exceeded {MISSED_LOSS:g} nats (with "
            f"answer-only retrieval loss a solved example costs ~1e-3, a missed one ~1-2).")


def printed_length_table(table: LengthTable) -> str:
    """The table as plain text (what `nsa report` prints)."""
    from ..bench.common import format_table  # torch comes with it: only runs with several lengths pay for it

    return f"loss by sequence length\n{describe_length_table(table)}\n" + format_table(length_cells(table),
                                                                                       LENGTH_COLUMNS)


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
        where = f"rank {', '.join(ranks)}" + (f", step {_step_range(steps)}" if steps else "")
        times = f" ({len(records)}x)" if len(records) > 1 else ""
        lines.append(f"**{event}** ({where}){times}: {message or '(no message)'}")
    return lines


def _step_range(steps: list[int]) -> str:
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
        "lr.png": lambda p: plot_metric(rows, "lr", "learning rate", "learning rate", p),
        "memory.png": lambda p: plot_metric(rows, "mem_gb", "GB", "memory (mem_gb)", p),
        "gates.png": lambda p: plot_gates_over_steps(series, p),
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
    table = length_table(rows)
    if table is not None:
        print(printed_length_table(table))
    return report


def summary_markdown(run: RunData, series: list[LayerSeries], images: list[str]) -> str:
    """The text of report.md."""
    parts = [f"# Run report: {run.run_dir.resolve().name}", "", _status_line(run), ""]
    parts += ["## Summary", "", "| | |", "|---|---|"]
    parts += [f"| {key} | {value} |" for key, value in summary_rows(run)]
    parts += [""] + _length_section(run.metrics)
    parts += ["## Health", ""]
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
    total = _nested_value(run.config, "train", "steps")
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
             f"Gates at the last record (step {step}); entropy in nats, at most ln 3 = {MAX_ENTROPY:.3f}; "
             "selection KL in nats, how far the blocks' scores are from where the selected branch's keys would "
             "attend (0: they agree):", "",
             "| layer | compressed | selected | window | entropy | forced share | selection KL |",
             "|---|---|---|---|---|---|---|"]
    for s in series:
        cmp_, sel, win = s.gate_mean[-1]
        lines.append(f"| {s.layer} | {cmp_:.3f} | {sel:.3f} | {win:.3f} | {_decimals_or_dash(s.entropy[-1])} "
                     f"| {_decimals_or_dash(s.sel_forced_share[-1])} | {_decimals_or_dash(s.sel_kl[-1])} |")
    spans = collapse_spans(series)
    lines += ["", f"Longest gate collapse: {describe_span(longest_collapse(spans))}; longest with a layer's attention "
              f"off (every gate < {COLLAPSE_LOW}): {describe_span(longest_collapse(spans, ATTENTION_OFF))}."]
    lowest = lowest_head_gate(series)
    if lowest is not None:
        lines += ["", describe_lowest_head(lowest)]
    warnings = gate_warnings(series)
    lines += ["", "Gate warnings:" if warnings else "Gate warnings: none.", ""]
    if warnings:
        lines += [f"- {w}" for w in warnings] + [""]
    return lines


def _length_section(rows: list[dict[str, float | None]]) -> list[str]:
    table = length_table(rows)
    if table is None:
        return []
    lines = ["## Loss by sequence length", "", describe_length_table(table), "",
             "| " + " | ".join(LENGTH_COLUMNS) + " |", "|---" * len(LENGTH_COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells[c] for c in LENGTH_COLUMNS) + " |" for cells in length_cells(table)]
    return lines + [""]


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


def _nested_value(mapping: dict, *keys: str) -> Any:
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


def _decimals_or_dash(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
