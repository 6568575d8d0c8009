"""The Wilson interval of an exact-match rate and the spread of a result over runs, against hand-computed values."""

import math

import pytest

from nsa.eval.intervals import Z_95, wilson_interval
from nsa.eval.spread import spread_of, spreads_by_kind


def test_wilson_interval_matches_hand_computed_bounds():
    z2 = Z_95 ** 2  # 3.841459
    # No hit of 32: from 0 to z^2 / (n + z^2); all 32: the mirror image.
    assert wilson_interval(0, 32) == (0.0, pytest.approx(z2 / (32 + z2)))
    assert wilson_interval(0, 32)[1] == pytest.approx(0.10718, abs=5e-6)
    assert wilson_interval(32, 32) == (pytest.approx(32 / (32 + z2)), 1.0)
    assert wilson_interval(32, 32)[0] == pytest.approx(0.89282, abs=5e-6)
    # 16 of 32: centred on 0.5, half-width z / (1 + z^2/n) * sqrt(1/(4n) + z^2/(4n^2)) = 0.16369.
    low, high = wilson_interval(16, 32)
    assert (low, high) == (pytest.approx(0.33631, abs=5e-6), pytest.approx(0.66369, abs=5e-6))
    # Off-centre: 8 of 32 (p = 0.25) is pulled towards 0.5: centre (0.25 + z^2/64) / (1 + z^2/32) = 0.27680,
    # half-width 1.74990 * sqrt(0.25 * 0.75 / 32 + z^2 / 4096) = 0.14427.
    low, high = wilson_interval(8, 32)
    assert (low + high) / 2 == pytest.approx((0.25 + z2 / 64) / (1 + z2 / 32))
    assert (low, high) == (pytest.approx(0.13252, abs=5e-5), pytest.approx(0.42107, abs=5e-5))
    # More samples, a narrower interval around the same rate.
    assert wilson_interval(64, 128)[1] - wilson_interval(64, 128)[0] < high - low
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="hits <= samples"):
        wilson_interval(5, 4)


def test_spread_counts_runs_seeds_and_reruns():
    # Seed 7 run twice (a rerun), seed 8 once, one run of unknown seed.
    s = spread_of([(7, 0.5), (7, 0.75), (8, 1.0), (None, 0.25)])
    assert (s.runs, s.seeds) == (4, 3)
    assert (s.mean, s.min, s.max, s.spread) == (0.625, 0.25, 1.0, 0.75)
    assert s.std == pytest.approx(math.sqrt(((0.125 ** 2) * 2 + 0.375 ** 2 * 2) / 3))
    one = spread_of([(1, 2.0)])
    assert (one.runs, one.seeds, one.spread, one.std) == (1, 1, 0.0, None)
    kinds = spreads_by_kind([("nsa", 1, 2.0), ("dense", 1, 3.0), ("nsa", 1, 2.4)])
    assert list(kinds) == ["nsa", "dense"]
    assert kinds["nsa"].as_dict() == {"runs": 2, "seeds": 1, "mean": pytest.approx(2.2), "min": 2.0, "max": 2.4,
                                      "spread": pytest.approx(0.4), "std": pytest.approx(0.2828427)}
    with pytest.raises(ValueError):
        spread_of([])
