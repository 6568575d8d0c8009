"""Figure setup, colours and saving shared by every plot."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

DPI = 110
BRANCH_COLORS = ("tab:blue", "tab:orange", "tab:green")
"""The colours of the compressed, selected and window branches, in every figure."""


def new_figure(width: float, height: float, constrained: bool = True):
    """A matplotlib Figure of the given size in inches; constrained=False leaves the layout to the caller."""
    # A bare Figure renders PNGs through Agg without pyplot: no global backend switch and no figure registry
    # to leak, so plotting is safe from a notebook or a training process.
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("the plots need matplotlib: pip install matplotlib") from None
    return Figure(figsize=(width, height), layout="constrained" if constrained else None, dpi=DPI)


def save_png(fig, path: Path) -> Path:
    """Write the figure to path as a PNG (creating its folder); returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def sequential_colors(n: int) -> list:
    """n colours along viridis, for lines in order (such as layers)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.9) for i in range(n)]
