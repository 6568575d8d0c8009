"""Gate figures: one run's gate means per layer over the steps (`nsa report`), and several runs' final gate
means per layer side by side (`nsa compare`). Branches keep one colour each (common.BRANCH_COLORS) and gates
one scale, 0 to 1."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..telemetry.run_files import BRANCH_NAMES, LayerSeries
from .common import BRANCH_COLORS, new_figure, save_png


def _gate_axis(ax, title: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1)


def plot_gates_over_steps(series: list[LayerSeries], path: Path) -> Path | None:
    """A panel per layer: each branch's gate mean over the steps, with a +-std band; None without layers."""
    if not series:
        return None
    ncols = min(4, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig = new_figure(3.2 * ncols, 2.4 * nrows + 0.4)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)).ravel()
    for i, (ax, s) in enumerate(zip(axes, series)):
        for b, (name, color) in enumerate(zip(BRANCH_NAMES, BRANCH_COLORS)):
            mean, std = s.gate_mean[:, b], s.gate_std[:, b]
            ax.plot(s.steps, mean, color=color, lw=1.2, label=name)
            ax.fill_between(s.steps, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1), color=color, alpha=0.2)
        _gate_axis(ax, f"layer {s.layer}")
        ax.grid(alpha=0.3)
        if i + ncols >= len(series):  # the lowest panel of its column
            ax.set_xlabel("step")
    for ax in axes[len(series):]:
        ax.set_axis_off()
    # One legend for the grid, outside the panels, so it never hides a collapsed gate's line or the title.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle("gate mean per branch (band: +-std)")
    return save_png(fig, path)


def plot_final_gates(runs: list[tuple[str, np.ndarray]], used_gate: float, path: Path) -> Path | None:
    """A panel per (title, gate means [layers, 3]): each branch's gate mean per layer as bars, with a dashed
    line at used_gate (the mean a branch needs to count as used); None without runs."""
    if not runs:
        return None
    fig = new_figure(max(5.0, 1.2 + 0.55 * max(len(per_layer) for _, per_layer in runs)) * len(runs), 3.6)
    axes = np.atleast_1d(fig.subplots(1, len(runs), squeeze=False)).ravel()
    for ax, (title, per_layer) in zip(axes, runs):
        layers = np.arange(len(per_layer))
        for b, (name, color) in enumerate(zip(BRANCH_NAMES, BRANCH_COLORS)):
            ax.bar(layers + (b - 1) * 0.27, per_layer[:, b], width=0.27, color=color, label=name)
        ax.axhline(used_gate, color="0.4", lw=0.8, ls="--")
        _gate_axis(ax, title)
        ax.set(xlabel="layer", ylabel="gate mean", xticks=layers)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return save_png(fig, path)
