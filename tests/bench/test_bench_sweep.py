"""`nsa bench attention --sweep`: every SWEEP entry sets its launch parameters (several at once for names joined
by '+') around the defaults while its row is measured, and the defaults come back afterwards. The timing itself
needs a GPU; here it is replaced by a recorder of the parameters in force."""

import dataclasses

import nsa.bench.attention as bench
from nsa.ops.tuning import TUNING

JOINED = "dkdv_block_n+dkdv_block_m+dkdv_warps+dkdv_stages"


def test_each_setting_is_in_force_while_measured_and_the_defaults_return(monkeypatch):
    seen = []

    def components(shape, T, batch=1):
        seen.append(dataclasses.replace(TUNING))
        return [{"stage": "fwd: x", "ms": 2.0}]

    monkeypatch.setattr(bench, "make_inputs", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "_nsa", lambda ins: None)
    monkeypatch.setattr(bench, "_fwd_bwd", lambda forward, ins: None)
    monkeypatch.setattr(bench, "_timed", lambda fn, queued=False: 3.0 if queued else 4.0 if fn == "replay" else 1.0)
    monkeypatch.setattr(bench, "_graphed", lambda fn: "replay")
    monkeypatch.setattr(bench, "components", components)
    defaults = dataclasses.replace(TUNING)

    rows = bench.sweep("m7c", 2048, params=[JOINED, "dkdv_stages"])

    assert TUNING == defaults
    assert [r["param"] for r in rows] == ["defaults"] + [k for k in bench.SWEEP for _ in bench.SWEEP[k]
                                                        if k in (JOINED, "dkdv_stages")]
    assert seen[0] == defaults
    by_row = dict(zip((r["param"] + r["value"] for r in rows), seen))
    for values in bench.SWEEP[JOINED]:
        tuned = by_row[JOINED + str(values)]
        assert (tuned.dkdv_block_n, tuned.dkdv_block_m, tuned.dkdv_warps, tuned.dkdv_stages) == values
        assert dataclasses.replace(tuned, **{f: getattr(defaults, f) for f in JOINED.split("+")}) == defaults
    stages = bench.SWEEP["dkdv_stages"][0]
    assert by_row[f"dkdv_stages{stages}"] == dataclasses.replace(defaults, dkdv_stages=stages) != defaults
    assert rows[1] | {"fwd: x": 2.0, "fwd_ms": 1.0, "gpu_fwdbwd_ms": 3.0, "graph_fwdbwd_ms": 4.0} == rows[1]


def test_every_sweep_name_is_a_launch_parameter():
    fields = {f.name for f in dataclasses.fields(TUNING)}
    for key, values in bench.SWEEP.items():
        names = key.split("+")
        assert set(names) <= fields, key
        assert values, key
        if len(names) > 1:
            assert all(len(v) == len(names) for v in values), key
