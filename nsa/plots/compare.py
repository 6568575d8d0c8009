"""`nsa compare`'s loss figure: training and validation loss of several runs against tokens seen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .common import new_figure, save_png

KIND_COLORS = {"nsa": ("tab:blue", "tab:cyan", "navy", "tab:purple"),
               "dense": ("tab:orange", "tab:red", "tab:brown", "gold")}
"""Colours per attention kind, so that the runs of one kind read as one family."""
OTHER_COLORS = ("tab:green", "tab:olive", "tab:pink", "tab:gray")


@dataclass
class LossCurves:
    """One run's losses against tokens seen."""

    label: str
    attention: str
    train_tokens: np.ndarray
    train_loss: np.ndarray
    val_tokens: np.ndarray
    val_loss: np.ndarray


def kind_colors(kinds: list[str]) -> list[str]:
    """A colour per run, from its attention kind's family, in turn."""
    used: dict[str, int] = {}
    out = []
    for kind in kinds:
        palette = KIND_COLORS.get(kind, OTHER_COLORS)
        out.append(palette[used.get(kind, 0) % len(palette)])
        used[kind] = used.get(kind, 0) + 1
    return out


def plot_losses(runs: list[LossCurves], path: Path) -> Path | None:
    """Training loss (left) and validation loss (right) of every run against tokens seen; None when no run
    logged a training loss."""
    if not any(r.train_tokens.size for r in runs):
        return None
    fig = new_figure(12, 4.5)
    ax_train, ax_val = fig.subplots(1, 2)
    for r, color in zip(runs, kind_colors([r.attention for r in runs])):
        ax_train.plot(r.train_tokens, r.train_loss, color=color, lw=1.2, label=r.label)
        if r.val_tokens.size:
            ax_val.plot(r.val_tokens, r.val_loss, "o-", color=color, ms=4, lw=1.2, label=r.label)
    ax_train.set(xlabel="tokens seen", ylabel="loss (nats per token)", title="training loss")
    ax_val.set(xlabel="tokens seen", ylabel="loss (nats per token)", title="validation loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
    ax_train.legend(fontsize=8)
    return save_png(fig, path)
