"""Retrieval results as a grid: one task's accuracy on one model by needle depth (down) and context length
(across), as the NSA paper's Figure 5 lays it out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Grid:
    """Accuracy of one task on one model: acc[i, j] at depths[i] and lengths[j]; nan where not measured."""

    title: str
    lengths: list[int]
    depths: list[float]
    acc: np.ndarray
    skipped: dict[int, str] = field(default_factory=dict)
    """Lengths that were not measured, with a short reason (e.g. 'out of memory')."""


def length_label(n: int) -> str:
    """4096 -> '4K'; lengths that are not whole multiples of 1024 as they are."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
