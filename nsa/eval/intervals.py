"""Confidence intervals of an exact-match rate: the Wilson score interval of k hits in n samples, and eval rows
(one per task, length and depth) pooled into one rate with its interval.

Wilson rather than the normal approximation p +- z sqrt(p(1-p)/n): at the rates retrieval gives (often 0 or 1)
the normal interval collapses to a point, claiming certainty that 32 samples cannot give; Wilson's stays inside
[0, 1] and keeps a width of about z^2 / (n + z^2) there.
"""

from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975: a two-sided 95% interval."""


def wilson_interval(hits: int, samples: int, z: float = Z_95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval of `hits` successes in `samples` trials; (0, 1) for no trials."""
    if samples < 0 or not 0 <= hits <= max(samples, 0):
        raise ValueError(f"need 0 <= hits <= samples, got {hits} of {samples}")
    if samples == 0:
        return 0.0, 1.0
    p = hits / samples
    z2n = z * z / samples
    center = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / samples + z2n / (4 * samples))
    # Clamped only against rounding: the exact bounds are 0 at no hits and 1 at all hits.
    return max(0.0, center - half), min(1.0, center + half)


def pooled_accuracy(cells: list[dict]) -> dict:
    """samples, correct, accuracy and its 95% Wilson interval (ci_low, ci_high) over all samples of eval rows
    (e.g. every depth of one task and length)."""
    samples = sum(r["samples"] for r in cells)
    correct = sum(r["correct"] for r in cells)
    low, high = wilson_interval(correct, samples)
    return {"samples": samples, "correct": correct, "accuracy": correct / samples, "ci_low": low, "ci_high": high}


def pooled_first_token(cells: list[dict]) -> float:
    """The share of all samples of eval rows whose key's first token was right."""
    return sum(r["first_token"] * r["samples"] for r in cells) / sum(r["samples"] for r in cells)
