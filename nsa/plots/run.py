"""The run report's figures (`nsa report`): loss, throughput, one metric over steps, selection statistics.
The gate figure is in nsa.plots.gates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..telemetry.run_files import LayerSeries, column, distance_histogram
from .common import new_figure, save_png, sequential_colors


def _spans_a_decade(values: np.ndarray) -> bool:
    positive = values[values > 0]
    return positive.size > 0 and positive.size == values.size and positive.max() > 10 * positive.min()


def plot_loss(rows: list[dict], path: Path) -> Path | None:
    """Training loss and validation points against the step (log scale where they span a decade); None without
    any loss."""
    steps, loss = column(rows, "loss")
    vsteps, vloss = column(rows, "val_loss")
    if not steps.size and not vsteps.size:
        return None
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(steps, loss, lw=1.2, label="train loss")
    if vsteps.size:
        ax.plot(vsteps, vloss, "o", ms=5, color="tab:red", label="validation loss")
    if _spans_a_decade(np.concatenate([loss, vloss])):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return save_png(fig, path)


def plot_throughput(rows: list[dict], path: Path) -> Path | None:
    """tokens/s against the step, with the data wait below it where logged; None without tokens_per_s."""
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


def plot_metric(rows: list[dict], key: str, ylabel: str, title: str, path: Path) -> Path | None:
    """One metrics.csv column against the step; None where it holds no number."""
    steps, values = column(rows, key)
    if not steps.size:
        return None
    fig = new_figure(7, 3.5)
    ax = fig.add_subplot()
    ax.plot(steps, values, lw=1.2)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return save_png(fig, path)


def plot_selection(stats: list[dict[str, Any]], series: list[LayerSeries], path: Path) -> Path | None:
    """The latest query-to-block distance histogram, and per layer over steps the mean distance, the forced share
    and, where logged, the selection KL; None without any of them."""
    histogram = distance_histogram(stats)
    panels = [("sel_distance_mean", "tokens", "mean distance to selected blocks", None),
              ("sel_forced_share", "share", "share of selected blocks that are forced", (0, 1)),
              ("sel_kl", "nats", "selection KL (blocks' scores vs. the selected keys' attention)", None)]
    panels = [panel for panel in panels if any(np.isfinite(getattr(s, panel[0])).any() for s in series)]
    if histogram is None and not panels:
        return None
    rows = (histogram is not None) + bool(panels)
    fig = new_figure(5 * max(2, len(panels)), 3.75 * rows + 0.25)
    grid = fig.add_gridspec(rows, max(1, len(panels)))
    if histogram is not None:
        _draw_histogram(fig.add_subplot(grid[0, :]), *histogram)
    axes = [fig.add_subplot(grid[rows - 1, i]) for i in range(len(panels))]
    for ax, (key, unit, title, ylim) in zip(axes, panels):
        for s, color in zip(series, sequential_colors(len(series))):
            ax.plot(s.steps, getattr(s, key), color=color, lw=1, label=f"layer {s.layer}")
        ax.set(xlabel="step", ylabel=unit, title=title, ylim=ylim)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    if axes and len(series) <= 12:
        axes[-1].legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
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
