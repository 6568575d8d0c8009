"""`nsa compare`: several runs side by side, the evidence that NSA learns.

- loss.png: training and validation loss of every run against tokens seen;
- the final validation losses, their distribution per attention kind (mean, min, max over its runs: several
  train.seed values, and reruns of one seed), and the margin between NSA and dense;
- retrieval_<task>.png: each run's `nsa eval` heatmap side by side (runs that have eval/eval.csv), and per task
  and length the distribution of the runs' exact match per attention kind;
- compare.csv and compare.json: those distributions (and compare.json each run's values);
- gates.png and a table: each NSA run's gate means per branch at its last nsa_stats.jsonl record, averaged
  over layers and per layer, whether all three branches are used, and the selection statistics.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..plots.compare import LossCurves, plot_losses
from ..plots.gates import plot_final_gates
from ..plots.retrieval import plot_grids
from ..telemetry.report import (ATTENTION_OFF, CollapseSpan, collapse_spans, describe_lowest_head, describe_span,
                                gate_warnings, human_count, longest_collapse, lowest_head_gate)
from ..telemetry.run_files import BRANCH_NAMES, RunData, column, layer_series, load_run
from .grid import Grid, length_label
from .intervals import wilson_interval
from .spread import Spread, spreads_by_kind

USED_GATE = 0.05
"""A branch counts as used when its gate mean, averaged over layers, is at least this (sigmoid gates start
near 0.5; the report's collapse warning fires below 0.02)."""


@dataclass
class GateSummary:
    """One NSA run's gate and selection statistics at its last nsa_stats.jsonl record."""

    step: int
    per_layer: np.ndarray
    """[layers, 3] gate means (compressed, selected, window)."""
    distance: float
    forced_share: float
    concentration: float
    warnings: list[str]
    longest_collapse: CollapseSpan | None = None
    """The longest span of records with a branch's gate collapsed, over the whole run."""
    longest_off: CollapseSpan | None = None
    """The longest span with a layer's attention off (every gate collapsed low at once)."""
    lowest_head: tuple[float, int, int, str, int, int] | None = None
    """telemetry.report.lowest_head_gate over the whole run; None where the records keep no per-head means."""

    @property
    def mean(self) -> np.ndarray:
        return self.per_layer.mean(axis=0)

    @property
    def all_used(self) -> bool:
        return bool((self.mean >= USED_GATE).all())


@dataclass
class RunSummary:
    name: str
    data: RunData
    attention: str
    seed: int | None
    last_step: int | None
    tokens: float | None
    val_tokens: np.ndarray
    val_loss: np.ndarray
    gates: GateSummary | None = None
    gate: str = "sigmoid"
    """The gate variant of an NSA run: model.nsa.gate, '-spreadP' with model.nsa.gate_spread_penalty P > 0 and
    '-floorF' with model.nsa.gate_floor F > 0."""
    model: dict[str, Any] = field(default_factory=dict)
    """The run's model settings, flattened ('nsa.window': 512), absent keys at ModelConfig's defaults."""
    variant: str = ""
    """'-window128' etc.: the other model settings in which this run differs from compared runs of its attention
    (label_variants)."""

    @property
    def kind(self) -> str:
        """What the runs are grouped by: the attention, for NSA a gate variant other than the default
        ('nsa-softmax', 'nsa-softmax-spread0.01'), and any other model setting that differs between the compared
        runs of that attention ('nsa-softmax-window128'), so that runs of two model variants are never pooled into
        one distribution."""
        base = f"{self.attention}-{self.gate}" if self.attention == "nsa" and self.gate != "sigmoid" else self.attention
        return base + self.variant

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        """eval/eval.csv's rows; empty before `nsa eval` (its cells then read '-')."""
        return self.data.eval_rows

    @property
    def eval_meta(self) -> dict[str, Any]:
        """eval/eval.json; empty before `nsa eval`."""
        return self.data.eval_summary

    @property
    def final_val(self) -> float | None:
        return float(self.val_loss[-1]) if self.val_loss.size else None

    def val_at(self, tokens: float) -> float | None:
        """The validation loss logged at exactly `tokens` tokens seen, if any."""
        hit = np.nonzero(self.val_tokens == tokens)[0]
        return float(self.val_loss[hit[-1]]) if hit.size else None


# -------------------------------------------------------------------------------------------- reading


def load_summary(run_dir: Path, name: str) -> RunSummary:
    run = load_run(run_dir)
    model = run.config.get("model") if isinstance(run.config.get("model"), dict) else {}
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    last = run.metrics[-1] if run.metrics else {}
    val_tokens, val_loss = column(run.metrics, "val_loss", x="tokens")
    return RunSummary(
        name=name, data=run, attention=str(model.get("attention", "?")),
        seed=train.get("seed") if isinstance(train.get("seed"), int) else None,
        last_step=int(last["step"]) if last.get("step") is not None else None, tokens=last.get("tokens"),
        val_tokens=val_tokens, val_loss=val_loss, gates=gate_summary(run),
        gate=_gate_variant(model.get("nsa") if isinstance(model.get("nsa"), dict) else {}),
        model=model_settings(model),
    )


GATE_KEYS = ("nsa.gate", "nsa.gate_spread_penalty", "nsa.gate_floor")
"""Model settings that RunSummary.gate names already."""
NOT_A_VARIANT = ("dense_backend", "nsa.backend", "init_from")
"""Model settings that choose a kernel or the starting weights, not the model: runs that differ only there pool."""


def model_settings(model: dict) -> dict[str, Any]:
    """A run's model section flattened ('nsa.window': 512) over ModelConfig's defaults, which absent keys had."""
    from ..model.config import ModelConfig
    from ..train.resume_rules import flatten
    from ..typed_config import to_dict

    return {**flatten(to_dict(ModelConfig())), **flatten(model)}


def label_variants(runs: list[RunSummary]) -> None:
    """Set each run's `variant` from the model settings that differ between the runs of its attention (a dense run's
    NSA settings do not count). A setting changed on resume counts by its final value (config.yaml's)."""
    for attention in {r.attention for r in runs}:
        group = [r for r in runs if r.attention == attention]
        keys = sorted({k for r in group for k in r.model}
                      - set(GATE_KEYS) - set(NOT_A_VARIANT) - {"attention"})
        if attention != "nsa":
            keys = [k for k in keys if not k.startswith("nsa.")]
        differing = [k for k in keys if len({repr(r.model.get(k)) for r in group}) > 1]
        for r in group:
            r.variant = "".join(f"-{k.split('.')[-1]}{_short(r.model.get(k))}" for k in differing)


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _gate_variant(nsa: dict) -> str:
    """RunSummary.gate from a run's model.nsa settings (absent keys: the defaults)."""
    penalty = float(nsa.get("gate_spread_penalty") or 0.0)
    floor = float(nsa.get("gate_floor") or 0.0)
    return (str(nsa.get("gate", "sigmoid")) + (f"-spread{penalty:g}" if penalty > 0 else "")
            + (f"-floor{floor:g}" if floor > 0 else ""))


def gate_summary(run: RunData) -> GateSummary | None:
    """Gate means per layer and branch, and the selection statistics, of the last complete stats record."""
    series = layer_series(run.stats)
    if not series:
        return None
    step = max(int(s.steps[-1]) for s in series)
    layers = [s for s in series if int(s.steps[-1]) == step]
    record = next((r for r in reversed(run.stats) if r.get("step") == step), {})
    entries = [e for e in record.get("layers", []) if isinstance(e, dict)]
    return GateSummary(
        step=step,
        per_layer=np.stack([s.gate_mean[-1] for s in layers]),
        distance=_mean([e.get("sel_distance_mean") for e in entries]),
        forced_share=_mean([e.get("sel_forced_share") for e in entries]),
        concentration=_mean([e.get("sel_concentration") for e in entries]),
        warnings=[w for w in gate_warnings(layers) if "collapsed" in w or "where they started" in w],
        longest_collapse=longest_collapse(collapse_spans(series)),
        longest_off=longest_collapse(collapse_spans(series), ATTENTION_OFF),
        lowest_head=lowest_head_gate(series),
    )


def _mean(values: list) -> float:
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(numbers) / len(numbers) if numbers else math.nan


def _run_names(run_dirs: list[Path]) -> list[str]:
    """Folder names; where two runs share one, their parent folder's name is added."""
    names = [d.resolve().name for d in run_dirs]
    return [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


# ---------------------------------------------------------------------------------------------- plots


def loss_curves(runs: list[RunSummary]) -> list[LossCurves]:
    """Every run's training and validation losses against tokens seen, labelled with its kind and seed."""
    curves = []
    for r in runs:
        label = f"{r.name} ({r.kind}" + (f", seed {r.seed})" if r.seed is not None else ")")
        tokens, loss = column(r.data.metrics, "loss", x="tokens")
        curves.append(LossCurves(label, r.attention, tokens, loss, r.val_tokens, r.val_loss))
    return curves


def final_gates(runs: list[RunSummary]) -> list[tuple[str, np.ndarray]]:
    """(title, gate means per layer) of every NSA run at its last health record."""
    return [(f"{r.name}, step {r.gates.step}", r.gates.per_layer) for r in runs if r.gates is not None]


def retrieval_grids(runs: list[RunSummary]) -> dict[str, list[Grid]]:
    """Per task, one grid per run that has eval rows for it, over the union of lengths and depths."""
    tasks = list(dict.fromkeys(row["task"] for r in runs for row in r.eval_rows))
    out = {}
    for task in tasks:
        rows = [row for r in runs for row in r.eval_rows if row["task"] == task]
        skipped = {(r.name, s.get("length")) for r in runs
                   for s in r.eval_meta.get("retrieval", {}).get("skipped", []) if s.get("task") == task}
        lengths = sorted({row["length"] for row in rows} | {n for _, n in skipped if isinstance(n, int)})
        depths = sorted({row["depth"] for row in rows})
        grids = []
        for r in runs:
            mine = [row for row in r.eval_rows if row["task"] == task]
            if not mine:
                continue
            acc = np.full((len(depths), len(lengths)), math.nan)
            for row in mine:
                acc[depths.index(row["depth"]), lengths.index(row["length"])] = row["accuracy"]
            reasons = {s["length"]: str(s.get("reason", "skipped")).split(" (")[0]
                       for s in r.eval_meta.get("retrieval", {}).get("skipped", [])
                       if s.get("task") == task and isinstance(s.get("length"), int)}
            grids.append(Grid(f"{r.name} ({r.kind})", lengths, depths, acc, reasons))
        out[task] = grids
    return out


# ------------------------------------------------------------------------------------ distributions


@dataclass
class Aggregates:
    """What the runs give per attention kind: compare.md, compare.csv and compare.json state these."""

    val_at: float | None
    """Tokens seen at which the validation losses are compared: the last validation every run reached, when
    the runs stopped at different token counts; None compares each run's final validation loss."""
    val_loss: dict[str, float]
    """Run name -> its validation loss compared (runs that logged one)."""
    validation: dict[str, Spread]
    """Attention kind -> the distribution of its runs' validation loss."""
    retrieval_by_run: dict[str, dict[str, dict[int, float]]]
    """Run name -> task -> length -> exact match over all samples of that length (every depth)."""
    retrieval: dict[str, dict[int, dict[str, Spread]]]
    """Task -> length -> attention kind -> the distribution of its runs' exact match."""


def retrieval_counts(rows: list[dict[str, Any]]) -> dict[str, dict[int, tuple[int, int]]]:
    """Task -> length -> (correct answers, samples) over every depth of that length in one run's eval rows."""
    counts: dict[str, dict[int, tuple[int, int]]] = {}
    for row in rows:
        by_length = counts.setdefault(row["task"], {})
        correct, samples = by_length.get(row["length"], (0, 0))
        by_length[row["length"]] = (correct + row["correct"], samples + row["samples"])
    return {task: dict(sorted(by_length.items())) for task, by_length in counts.items()}


def retrieval_means(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Task -> length -> the share of correct answers over all samples of that length in one run's eval rows."""
    return {task: {n: correct / samples for n, (correct, samples) in by_length.items() if samples}
            for task, by_length in retrieval_counts(rows).items()}


def aggregate(runs: list[RunSummary]) -> Aggregates:
    """The validation loss and exact match of every run, and their distribution per attention kind."""
    with_val = [r for r in runs if r.final_val is not None]
    at = _common_tokens(with_val) if len({r.tokens for r in with_val}) > 1 else None
    val_loss = {r.name: r.val_at(at) if at is not None else r.final_val for r in with_val}
    val_loss = {name: value for name, value in val_loss.items() if value is not None}
    validation = spreads_by_kind((r.kind, r.seed, val_loss[r.name]) for r in with_val if r.name in val_loss)
    by_run = {r.name: retrieval_means(r.eval_rows) for r in runs if r.eval_rows}
    retrieval: dict[str, dict[int, dict[str, Spread]]] = {}
    for task in dict.fromkeys(task for means in by_run.values() for task in means):
        lengths = sorted({n for means in by_run.values() for n in means.get(task, {})})
        retrieval[task] = {n: spreads_by_kind((r.kind, r.seed, by_run[r.name][task][n]) for r in runs
                                              if n in by_run.get(r.name, {}).get(task, {}))
                           for n in lengths}
    return Aggregates(at, val_loss, validation, by_run, retrieval)


# ----------------------------------------------------------------------------------------- the report


def render_compare(run_dirs: list[Path], out: Path) -> Path:
    """Write compare.md and its PNGs into `out`; returns compare.md."""
    if not run_dirs:
        raise UserError("nsa compare needs at least one run folder")
    runs = [load_summary(Path(d), name) for d, name in zip(run_dirs, _run_names([Path(d) for d in run_dirs]))]
    label_variants(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    if plot_losses(loss_curves(runs), out / "loss.png") is not None:
        images.append("loss.png")
    grids = retrieval_grids(runs)
    for task, task_grids in grids.items():
        plot_grids(task_grids, out / f"retrieval_{task}.png", title=f"{task}: exact-match accuracy")
    if plot_final_gates(final_gates(runs), USED_GATE, out / "gates.png") is not None:
        images.append("gates.png")
    # Images a previous comparison wrote and this one did not are removed: the folder shows one comparison.
    keep = set(images) | {f"retrieval_{t}.png" for t in grids}
    for old in out.glob("*.png"):
        if old.name not in keep:
            old.unlink()
    agg = aggregate(runs)
    write_distributions(out, runs, agg)
    report = out / "compare.md"
    report.write_text(compare_markdown(runs, grids, images, agg), encoding="utf-8")
    print(printed_distributions(agg))
    return report


def compare_markdown(runs: list[RunSummary], grids: dict[str, list[Grid]], images: list[str],
                     agg: Aggregates) -> str:
    parts = [f"# Comparison: {', '.join(r.name for r in runs)}", ""]
    parts += ["| run | attention | seed | steps | tokens seen | final val loss | best val loss | nsa eval: val loss "
              "(perplexity) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        best = f"{float(r.val_loss.min()):.4f}" if r.val_loss.size else "-"
        parts.append(f"| {r.name} | {r.kind} | {_or_dash(r.seed, grouped=False)} | {_or_dash(r.last_step)} | "
                     f"{human_count(r.tokens) if r.tokens is not None else '-'} | {_number_or_dash(r.final_val)} | {best} | "
                     f"{_eval_validation(r.eval_meta)} |")
    parts += [""] + _validation_section(runs, agg)
    if "loss.png" in images:
        parts += ["![](loss.png)", ""]
    parts += _retrieval_section(runs, grids, agg)
    parts += _gate_section(runs, "gates.png" in images)
    return "\n".join(parts).rstrip() + "\n"


def _eval_validation(meta: dict[str, Any]) -> str:
    """`nsa eval`'s validation loss and perplexity (more batches than the trainer's), with its step."""
    val = meta.get("validation") if isinstance(meta.get("validation"), dict) else None
    if not val or not isinstance(val.get("loss"), (int, float)):
        return "-"
    return f"{val['loss']:.4f} ({val.get('perplexity', math.nan):.3f}) at step {meta.get('step', '?')}"


def _validation_section(runs: list[RunSummary], agg: Aggregates) -> list[str]:
    lines = ["## Validation loss", ""]
    with_val = [r for r in runs if r.final_val is not None]
    if not with_val:
        return lines + ["No run logged a validation loss (train.eval_every=0, or data.val_fraction=0).", ""]
    # Runs cut at different points are compared at the last validation they all reached, when there is one.
    if len({r.tokens for r in with_val}) > 1:
        lines += [f"The runs stopped at different token counts; they are compared at the last validation all of "
                  f"them reached: {human_count(agg.val_at)} tokens." if agg.val_at is not None else
                  "The runs stopped at different token counts and share no validation point; their final values "
                  "are compared.", ""]
    lines += ["Per attention kind, over all of its runs (train.seed values, and reruns of one seed):", "",
              "| attention | runs | seeds | mean val loss | min | max | spread (max - min) | std |",
              "|---|---|---|---|---|---|---|---|"]
    for kind, s in agg.validation.items():
        lines.append(f"| {kind} | {s.runs} | {s.seeds} | {s.mean:.4f} | {s.min:.4f} | {s.max:.4f} | "
                     f"{_spread_or_one_run(s)} | {_number_or_dash(s.std)} |")
    lines.append("")
    means = {kind: s.mean for kind, s in agg.validation.items()}
    spreads = {kind: s.spread for kind, s in agg.validation.items() if s.runs > 1}
    for nsa_kind in (k for k in means if k.startswith("nsa") and "dense" in means):
        margin = means[nsa_kind] - means["dense"]
        better = "lower (better)" if margin < 0 else "higher (worse)" if margin > 0 else "equal"
        name = "NSA" if nsa_kind == "nsa" else f"NSA ({nsa_kind})"
        lines.append(f"**Margin:** {name}'s mean validation loss is {abs(margin):.4f} nats {better} than dense's"
                     f"{_relative_margin(margin, means['dense'])}.")
        if spreads:
            widest = max(spreads.values())
            verdict = "larger" if abs(margin) > widest else "not larger"
            lines.append(f"The margin is {verdict} than the widest spread between runs of one kind ({widest:.4f}).")
        else:
            lines.append("One run per kind: no spread between runs to compare the margin with.")
        lines.append("")
    return lines


RELATIVE_MARGIN_MIN_LOSS = 0.01
"""Below this dense validation loss (nats) a margin is not also given in percent: a task solved to a loss near
zero (retrieval) would turn a margin of 0.003 nats into thousands of percent."""


def _relative_margin(margin: float, dense_loss: float) -> str:
    """' (+1.23%)' of dense's loss, or '' where dense's loss is too near zero for a ratio to mean anything."""
    return f" ({100 * margin / dense_loss:+.2f}%)" if dense_loss >= RELATIVE_MARGIN_MIN_LOSS else ""


def _common_tokens(runs: list[RunSummary]) -> float | None:
    shared = set(runs[0].val_tokens.tolist())
    for r in runs[1:]:
        shared &= set(r.val_tokens.tolist())
    return max(shared) if shared else None


def _retrieval_section(runs: list[RunSummary], grids: dict[str, list[Grid]], agg: Aggregates) -> list[str]:
    lines = ["## Retrieval (exact match, `nsa eval`)", ""]
    missing = [r.name for r in runs if not r.eval_rows]
    if not grids:
        return lines + ["No run has retrieval results in eval/eval.csv (`nsa eval RUN_DIR --tasks passkey,kv`).", ""]
    for task, task_grids in grids.items():
        lengths = task_grids[0].lengths
        lines += [f"### {task}", "", "Each run's exact match over all samples of a context length (every depth), "
                  "with its 95% interval:", "",
                  "| run | " + " | ".join(length_label(n) for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        measured = [r for r in runs if any(row["task"] == task for row in r.eval_rows)]
        for r, grid in zip(measured, task_grids):  # retrieval_grids makes one grid per such run, in order
            counts = retrieval_counts(r.eval_rows)[task]
            cells = [_rate_with_interval(*counts[n]) if n in counts else grid.skipped.get(n, "-") for n in lengths]
            lines.append(f"| {grid.title} | " + " | ".join(cells) + " |")
        lines += _first_token_table(runs, task, lengths)
        lines += _needle_selected_table(runs, task, lengths)
        lines += _retrieval_spread_table(agg.retrieval.get(task, {}))
        lines += ["", f"![](retrieval_{task}.png)", ""]
    for r in runs:
        meta = r.eval_meta
        if meta and r.eval_rows:
            trained = meta.get("trained_seq_len")
            lines.append(f"- {r.name}: step {meta.get('step', '?')}, trained at {trained} tokens, "
                         f"samples per cell: {meta.get('retrieval', {}).get('samples', '?')}, on {meta.get('device', '?')}")
    if missing:
        lines.append(f"- no retrieval results: {', '.join(missing)}")
    return lines + [""]


def _retrieval_spread_table(by_length: dict[int, dict[str, Spread]]) -> list[str]:
    """Per attention kind and length, the distribution of its runs' exact match (each over all samples of a
    length)."""
    if not by_length:
        return []
    lines = ["", "Per attention kind, over all of its runs (each run's exact match over every sample of a length):",
             "", "| attention | length | runs | seeds | mean | min | max | spread (max - min) |",
             "|---|---|---|---|---|---|---|---|"]
    kinds = list(dict.fromkeys(kind for spreads in by_length.values() for kind in spreads))
    for kind in kinds:
        for n, spreads in by_length.items():
            if kind in spreads:
                s = spreads[kind]
                lines.append(f"| {kind} | {length_label(n)} | {s.runs} | {s.seeds} | {s.mean:.2f} | {s.min:.2f} | "
                             f"{s.max:.2f} | {_spread_or_one_run(s, 2)} |")
    return lines


def _rate_with_interval(correct: int, samples: int) -> str:
    low, high = wilson_interval(correct, samples)
    return f"{correct / samples:.2f} ({low:.2f}-{high:.2f})"


def _spread_or_one_run(s: Spread, digits: int = 4) -> str:
    return f"{s.spread:.{digits}f}" if s.runs > 1 else "one run"


def _needle_selected_table(runs: list[RunSummary], task: str, lengths: list[int]) -> list[str]:
    """NSA runs' share of (layer, kv group) whose selection at a query of the question held the needle, per length."""
    return _eval_share_table(runs, task, lengths, "needle_selected",
                             "Needle block selected at a query of the question (NSA: share of layers x kv groups, "
                             "mean over depths; forced blocks count):")


def _first_token_table(runs: list[RunSummary], task: str, lengths: list[int]) -> list[str]:
    """Per run and length, the share of samples whose key's first token was right (evaluations that record it)."""
    return _eval_share_table(runs, task, lengths, "first_token",
                             "The key's first token right (share of all samples of a length; a miss with it right "
                             "found the key and lost the copy after it):")


def _eval_share_table(runs: list[RunSummary], task: str, lengths: list[int], key: str, heading: str) -> list[str]:
    """A run x length table of eval.json's retrieval[key][task][length]; nothing when no run has that key."""
    shares = {r.name: (r.eval_meta or {}).get("retrieval", {}).get(key, {}).get(task) for r in runs}
    shares = {name: by_length for name, by_length in shares.items() if by_length}
    if not shares:
        return []
    lines = ["", heading, "", "| run | " + " | ".join(length_label(n) for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name, by_length in shares.items():
        cells = [f"{by_length[str(n)]:.2f}" if str(n) in by_length else "-" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------- compare.csv / .json


DISTRIBUTION_FIELDS = ["metric", "task", "length", "attention", "runs", "seeds", "mean", "min", "max", "spread", "std"]
"""compare.csv's columns: one row per metric (val_loss, exact_match), task and length (exact_match only) and
attention kind."""


def distribution_rows(agg: Aggregates) -> list[dict[str, Any]]:
    rows = [{"metric": "val_loss", "task": "", "length": "", "attention": kind, **s.as_dict()}
            for kind, s in agg.validation.items()]
    for task, by_length in agg.retrieval.items():
        for n, spreads in by_length.items():
            rows += [{"metric": "exact_match", "task": task, "length": n, "attention": kind, **s.as_dict()}
                     for kind, s in spreads.items()]
    return rows


def write_distributions(out: Path, runs: list[RunSummary], agg: Aggregates) -> None:
    """compare.csv (the distributions per attention kind) and compare.json (the same, and every run's values)."""
    with open(out / "compare.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=DISTRIBUTION_FIELDS)
        writer.writeheader()
        for row in distribution_rows(agg):
            writer.writerow({key: "" if value is None else value for key, value in row.items()})
    summary = {
        "runs": [{"name": r.name, "run_dir": str(r.data.run_dir), "attention": r.attention, "seed": r.seed,
                  "last_step": r.last_step, "tokens": r.tokens, "val_loss": agg.val_loss.get(r.name),
                  "exact_match": {task: {str(n): v for n, v in by_length.items()}
                                  for task, by_length in agg.retrieval_by_run.get(r.name, {}).items()}}
                 for r in runs],
        "val_loss_at_tokens": agg.val_at,
        "val_loss": {kind: s.as_dict() for kind, s in agg.validation.items()},
        "exact_match": {task: {str(n): {kind: s.as_dict() for kind, s in spreads.items()}
                               for n, spreads in by_length.items()} for task, by_length in agg.retrieval.items()},
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")


def printed_distributions(agg: Aggregates) -> str:
    """The distributions per attention kind as plain-text tables (what `nsa compare` prints)."""
    from ..bench.common import format_table

    columns = ["metric", "attention", "runs", "seeds", "mean", "min", "max", "spread"]
    table = []
    for row in distribution_rows(agg):
        digits = 4 if row["metric"] == "val_loss" else 2
        name = "val loss" if row["metric"] == "val_loss" else f"{row['task']} {length_label(row['length'])}"
        table.append({"metric": name, "attention": row["attention"], "runs": row["runs"], "seeds": row["seeds"],
                      **{key: f"{row[key]:.{digits}f}" for key in ("mean", "min", "max", "spread")}})
    if not table:
        return "no validation loss or retrieval result to compare"
    return "per attention kind, over its runs (val loss: lower is better; retrieval: exact match)\n" + format_table(
        table, columns)


def _gate_section(runs: list[RunSummary], has_plot: bool) -> list[str]:
    lines = ["## NSA gates and selection at the end of training", ""]
    nsa = [r for r in runs if r.gates is not None]
    if not nsa:
        return lines + ["No run has nsa_stats.jsonl records (dense runs have none).", ""]
    lines += [f"Gate means per branch at the last health record, averaged over layers (a branch counts as used "
              f"when that mean is >= {USED_GATE}); selection: mean query-to-block distance, share of forced "
              "blocks, concentration, averaged over layers.", "",
              "| run | step | compressed | selected | window | all three used? | lowest layer gate | distance | "
              "forced share | concentration |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in nsa:
        g = r.gates
        low_layer, low_branch = np.unravel_index(int(np.argmin(g.per_layer)), g.per_layer.shape)
        lowest = f"{g.per_layer[low_layer, low_branch]:.3f} (layer {low_layer}, {BRANCH_NAMES[low_branch]})"
        unused = [BRANCH_NAMES[b] for b in range(3) if g.mean[b] < USED_GATE]
        used = "yes" if g.all_used else f"no ({', '.join(unused)} below {USED_GATE})"
        lines.append(f"| {r.name} | {g.step} | {g.mean[0]:.3f} | {g.mean[1]:.3f} | {g.mean[2]:.3f} | {used} | "
                     f"{lowest} | {_number_or_dash(g.distance, 1)} | {_number_or_dash(g.forced_share, 3)} | {_number_or_dash(g.concentration, 3)} |")
    lines.append("")
    for r in nsa:
        lines += [f"Per layer, {r.name} (step {r.gates.step}):", "", "| layer | compressed | selected | window |",
                  "|---|---|---|---|"]
        lines += [f"| {i} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} |" for i, row in enumerate(r.gates.per_layer)]
        lines.append("")
        lines += [f"Longest gate collapse: {describe_span(r.gates.longest_collapse)}; longest with a layer's "
                  f"attention off: {describe_span(r.gates.longest_off)}.", ""]
        if r.gates.lowest_head is not None:
            lines += [describe_lowest_head(r.gates.lowest_head), ""]
        if r.gates.warnings:
            lines += [f"- {w}" for w in r.gates.warnings] + [""]
    if has_plot:
        lines += ["![](gates.png)", ""]
    return lines


def _number_or_dash(value: float | None, digits: int = 4) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _or_dash(value: Any, grouped: bool = True) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) and grouped else str(value)
