"""Which layers does retrieval rest on? The retrieval grid once with every layer's attention in place, then once
per layer with that layer's attention removed (`ablation.ablated_attention`), pooled per task and length into one
table and one picture (`nsa eval --ablate-each-layer`).

A layer whose removal leaves the accuracy where it was is not needed for the task (another layer can do its part);
one whose removal loses the task carries it alone. A model whose every layer can go at a small cost holds the task
redundantly.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

from torch import nn

from .ablation import ablated_attention
from .grid import length_label
from .intervals import pooled_accuracy, pooled_first_token

SWEEP_FIELDS = ["ablated", "task", "length", "samples", "correct", "accuracy", "ci_low", "ci_high", "first_token"]
NONE = "none"
"""The `ablated` label of the pass with every layer's attention in place."""


def sweep(model: nn.Module, score: Callable[[], list[dict]], announce: Callable[[str], object] = print
          ) -> list[dict]:
    """Rows {ablated, task, length, samples, correct, accuracy, ci_low, ci_high, first_token}, ablated "none" then
    "0", "1", ... (one per layer of model.layers), each pooled over the depths of score()'s eval rows (task,
    length, samples, correct, first_token per cell), which score() measures under the ablation in force."""
    rows = []
    for layers in [[]] + [[i] for i in range(len(model.layers))]:
        label = str(layers[0]) if layers else NONE
        announce(f"attention removed in layer {label}" if layers else "every layer's attention in place")
        with ablated_attention(model, layers):
            cells = score()
        rows += pooled_by_length(cells, label)
    return rows


def pooled_by_length(cells: list[dict], ablated: str) -> list[dict]:
    """Eval rows (one per task, length and depth) pooled over the depths: one row per (task, length), in order."""
    out = []
    keys = list(dict.fromkeys((r["task"], r["length"]) for r in cells))
    for task, length in keys:
        group = [r for r in cells if r["task"] == task and r["length"] == length]
        out.append({"ablated": ablated, "task": task, "length": length, **pooled_accuracy(group),
                    "first_token": pooled_first_token(group)})
    return out


def sweep_table(rows: list[dict], task: str, lengths: list[int]) -> str:
    """Exact match with its 95% interval, by the layer whose attention was removed (rows) and length (columns)."""
    from ..bench.common import format_table

    columns = ["attention removed in"] + [length_label(n) for n in lengths]
    table = []
    for label in dict.fromkeys(r["ablated"] for r in rows):
        line = {"attention removed in": _removed_in(label)}
        for n in lengths:
            cell = [r for r in rows if r["ablated"] == label and r["task"] == task and r["length"] == n]
            line[length_label(n)] = (f"{cell[0]['accuracy']:.2f} ({cell[0]['ci_low']:.2f}-{cell[0]['ci_high']:.2f})"
                                     if cell else "skip")
        table.append(line)
    return format_table(table, columns)


def write_sweep(out: Path, rows: list[dict], lengths: list[int], title: str) -> list[Path]:
    """ablation.csv (every row) and ablation_<task>.png (exact match by removed layer and length) in `out`."""
    from ..plots.retrieval import plot_layer_ablation

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ablation.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=SWEEP_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, **{k: f"{r[k]:.4f}" for k in ("accuracy", "ci_low", "ci_high", "first_token")}})
    labels = list(dict.fromkeys(r["ablated"] for r in rows))
    names = [_removed_in(label) for label in labels]
    images = []
    for task in dict.fromkeys(r["task"] for r in rows):
        acc = [[next((r["accuracy"] for r in rows if r["ablated"] == label and r["task"] == task
                      and r["length"] == n), float("nan")) for n in lengths] for label in labels]
        images.append(plot_layer_ablation(acc, names, lengths, out / f"ablation_{task}.png", f"{task}, {title}"))
    return images


def _removed_in(label: str) -> str:
    """A row's name in the table and the picture: 'none', or 'layer 3'."""
    return "none" if label == NONE else f"layer {label}"
