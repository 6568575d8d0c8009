"""The distribution of a result over the runs of one attention kind, for `nsa compare`.

Runs of one kind differ by train.seed, and runs of one seed differ too (reruns: on a GPU, float atomics make
two runs of one seed diverge). A comparison states how a kind's runs are distributed (mean, min, max, how
many runs and seeds), never its best run alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """One result over the runs of one attention kind."""

    runs: int
    seeds: int
    """Distinct train.seed values among the runs; runs - seeds of them are reruns of a seed. A run whose seed is
    unknown counts as a seed of its own."""
    mean: float
    min: float
    max: float
    std: float | None
    """Sample standard deviation over the runs; None for one run."""

    @property
    def spread(self) -> float:
        """max - min: 0 for one run."""
        return self.max - self.min

    def as_dict(self) -> dict[str, float | int | None]:
        return {"runs": self.runs, "seeds": self.seeds, "mean": self.mean, "min": self.min, "max": self.max,
                "spread": self.spread, "std": self.std}


def spread_of(values: list[tuple[int | None, float]]) -> Spread:
    """The Spread of (seed, value) pairs, one per run (at least one)."""
    if not values:
        raise ValueError("a spread needs at least one run")
    numbers = [v for _, v in values]
    known = {seed for seed, _ in values if seed is not None}
    unknown = sum(seed is None for seed, _ in values)
    return Spread(runs=len(values), seeds=len(known) + unknown, mean=statistics.fmean(numbers), min=min(numbers),
                  max=max(numbers), std=statistics.stdev(numbers) if len(numbers) > 1 else None)


def spreads_by_kind(results: Iterable[tuple[str, int | None, float]]) -> dict[str, Spread]:
    """{attention kind: Spread} of (kind, seed, value) results, one per run; kinds in first-seen order."""
    grouped: dict[str, list[tuple[int | None, float]]] = {}
    for kind, seed, value in results:
        grouped.setdefault(kind, []).append((seed, value))
    return {kind: spread_of(values) for kind, values in grouped.items()}
