"""Retrieval accuracy heatmaps (`nsa eval`, `nsa compare`): context length across, needle depth down."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..eval.grid import Grid, length_label
from .common import new_figure, save_png

ANNOTATED_CELLS = 160
"""Grids of at most this many cells print each cell's accuracy; larger ones would be unreadable."""
GRIDS_PER_ROW = 4
"""Runs side by side before the heatmaps wrap to another row (a grid of seeds x reruns stays readable)."""


def _accuracy_map(ax, acc: np.ndarray, lengths: Sequence[int], row_labels: Sequence[str], ylabel: str, title: str,
                  annotate: bool, fontsize: int):
    """acc [rows, lengths] as a red-to-green heatmap of 0..1 on `ax`, lengths across, each measured cell
    labelled with its percentage when `annotate`; returns the image (for a colorbar)."""
    from matplotlib import colormaps

    cmap = colormaps["RdYlGn"].with_extremes(bad="0.85")  # unmeasured cells in light grey
    image = ax.imshow(np.ma.masked_invalid(acc), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(row_labels)), list(row_labels))
    ax.set(xlabel="context length (tokens)", ylabel=ylabel, title=title)
    for i in range(len(row_labels)):
        for j in range(len(lengths)):
            if annotate and math.isfinite(acc[i, j]):
                ax.text(j, i, f"{100 * acc[i, j]:.0f}", ha="center", va="center", fontsize=fontsize, color="black")
    return image


def draw_grid(ax, grid: Grid, annotate: bool = True):
    """One heatmap on a matplotlib axis; returns the image (for a colorbar)."""
    small = len(grid.lengths) * len(grid.depths) <= ANNOTATED_CELLS
    image = _accuracy_map(ax, grid.acc, grid.lengths, [f"{100 * d:.0f}%" for d in grid.depths], "needle depth",
                          grid.title, annotate and small, 7)
    middle = len(grid.depths) // 2
    for j, n in enumerate(grid.lengths):
        if not math.isfinite(grid.acc[middle, j]):
            ax.text(j, middle, _shortened(grid.skipped.get(n, "n/a")), ha="center", va="center", fontsize=7,
                    rotation=90, color="0.3")
    return image


def _shortened(reason: str) -> str:
    return reason if len(reason) <= 14 else reason[:13] + "…"


def plot_grids(grids: Sequence[Grid], path: Path, title: str = "", label: str = "exact-match accuracy") -> Path:
    """The grids side by side, at most GRIDS_PER_ROW to a row, with one colour bar (0..1, named `label`)."""
    n = len(grids)
    columns, rows = min(n, GRIDS_PER_ROW), -(-n // GRIDS_PER_ROW)
    width = max(len(g.lengths) for g in grids)
    height = max(len(g.depths) for g in grids)
    panel_width = min(4.0 + 0.55 * width, 8.0) if n > 1 else 2.5 + 0.7 * width
    fig = new_figure(panel_width * columns, (1.6 + 0.32 * height) * rows)
    axes = np.atleast_1d(fig.subplots(rows, columns, squeeze=False)).ravel()
    image = None
    for ax, grid in zip(axes, grids):
        image = draw_grid(ax, grid)
    for ax in axes[n:]:  # the last row's empty places
        ax.set_axis_off()
    axes = axes[:n]
    fig.colorbar(image, ax=list(axes), label=label, shrink=0.9)
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def plot_layer_ablation(acc: Sequence[Sequence[float]], rows: Sequence[str], lengths: Sequence[int], path: Path,
                        title: str) -> Path:
    """Exact match acc[i][j] with the attention of rows[i] removed ("none": every layer in place) at lengths[j], as
    one heatmap (nan: not measured)."""
    fig = new_figure(2.6 + 0.8 * len(lengths), 1.4 + 0.32 * len(rows))
    ax = fig.subplots()
    image = _accuracy_map(ax, np.asarray(acc, dtype=float), lengths, rows, "attention removed in", title, True, 8)
    fig.colorbar(image, ax=ax, label="exact-match accuracy", shrink=0.9)
    return save_png(fig, path)
