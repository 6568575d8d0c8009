"""The benchmarks' pictures: which numbers each panel draws (the right columns, per shape or batch, sorted by
length, missing ratios left out), that a saved JSON redraws to a readable PNG, and one-line errors for files that
are not benchmark results."""

import json

import pytest

from nsa.plots import bench as plot
from nsa.bench.common import write_results
from nsa.cli import main
from nsa.errors import UserError

ATTENTION = [  # as nsa bench attention writes them: lengths out of order, fla only where it runs
    {"shape": "paper 64/4/128", "T": 8192, "nsa_fwd_ms": 4.0, "speedup_fwd": 0.8, "vs_cudnn_fwd": 0.45,
     "vs_fla_fwd": 1.1, "speedup_fwdbwd": 1.1, "vs_cudnn_fwdbwd": 0.66, "vs_fla_fwdbwd": 1.9},
    {"shape": "paper 64/4/128", "T": 2048, "nsa_fwd_ms": 1.6, "speedup_fwd": 0.2, "vs_cudnn_fwd": 0.11,
     "vs_fla_fwd": 1.0, "speedup_fwdbwd": 0.4, "vs_cudnn_fwdbwd": 0.23, "vs_fla_fwdbwd": 1.8},
    {"shape": "m7c 12/2/64", "T": 65536, "nsa_fwd_ms": 7.1, "speedup_fwd": 3.0, "vs_cudnn_fwd": 2.0,
     "vs_fla_fwd": None, "speedup_fwdbwd": 5.2, "vs_cudnn_fwdbwd": 3.4, "vs_fla_fwdbwd": None},
]
DECODE = [
    {"attention": "nsa", "context": 65536, "batch": 16, "step_ms": 1.3, "speedup": 2.3, "attention_speedup": 3.6},
    {"attention": "dense", "context": 65536, "batch": 16, "step_ms": 3.0, "speedup": 1.0, "attention_speedup": 1.0},
    {"attention": "nsa", "context": 16384, "batch": 1, "step_ms": 0.8, "speedup": 0.8, "attention_speedup": 1.2},
    {"attention": "nsa", "context": 65536, "batch": 1, "step_ms": 0.83, "speedup": 0.94, "attention_speedup": 1.6},
]
TRAIN = [
    {"attention": "nsa", "seq_len": 32768, "ranks": 1, "mode": "single", "tokens_per_s": 264e3, "vs_dense": 1.75},
    {"attention": "dense", "seq_len": 32768, "ranks": 1, "mode": "single", "tokens_per_s": 151e3, "vs_dense": 1.0},
    {"attention": "nsa", "seq_len": 2048, "ranks": 2, "mode": "ddp", "tokens_per_s": 700e3, "vs_dense": None},
]


def test_attention_panels_hold_each_reference_per_shape_sorted_by_length():
    panels = plot.attention_series(ATTENTION)
    fwd = panels["forward"]
    assert fwd["paper 64/4/128 vs dense (SDPA flash)"] == [(2048, 0.2), (8192, 0.8)]
    assert fwd["paper 64/4/128 vs dense (cuDNN)"] == [(2048, 0.11), (8192, 0.45)]
    assert panels["forward + backward"]["m7c 12/2/64 vs dense (cuDNN)"] == [(65536, 3.4)]
    assert "m7c 12/2/64 vs fla parallel_nsa" not in fwd  # fla refuses M7C's group size: no line, not zeros


def test_decode_panels_are_nsa_rows_per_batch():
    panels = plot.decode_series(DECODE)
    assert panels["whole decode step"] == {"batch 1": [(16384, 0.8), (65536, 0.94)], "batch 16": [(65536, 2.3)]}
    assert panels["one layer's attention"]["batch 1"] == [(16384, 1.2), (65536, 1.6)]


def test_train_panels_separate_parallel_modes_and_skip_missing_ratios():
    panels = plot.train_series(TRAIN)
    assert panels["tokens/s"] == {"nsa": [(32768, 264e3)], "dense": [(32768, 151e3)],
                                  "nsa (ddp, 2 GPUs)": [(2048, 700e3)]}
    assert panels["NSA / dense tokens/s"] == {"nsa / dense": [(32768, 1.75)]}


def test_train_ratios_and_panels_hold_one_line_per_dense_reference():
    from nsa.bench.training import _with_ratios, table_columns

    rows = _with_ratios([{"attention": a, "seq_len": 32768, "ranks": 1, "mode": "single", "tokens_per_s": tok}
                         for a, tok in (("nsa", 300e3), ("dense", 150e3), ("dense:flash", 100e3))])
    assert [(r["vs_dense"], r["vs_dense_flash"]) for r in rows] == [(2.0, 3.0), (1.0, 1.5), (2 / 3, 1.0)]
    assert {"vs_dense", "vs_dense_flash"} <= set(table_columns(rows))
    assert plot.train_series(rows)["NSA / dense tokens/s"] == {"nsa / dense": [(32768, 2.0)],
                                                               "nsa / dense:flash": [(32768, 3.0)]}


@pytest.mark.parametrize("rows,name", [(ATTENTION, "attention"), (DECODE, "decode_compiled"), (TRAIN, "train_1rank")])
def test_saved_results_redraw_to_a_png(tmp_path, rows, name, capsys):
    import matplotlib.image

    _, json_path = write_results(rows, tmp_path, name, {"device": "test GPU", "torch": "x"})
    assert main(["bench", "plot", str(json_path)]) == 0
    png = json_path.with_suffix(".png")
    assert f"wrote {png}" in capsys.readouterr().out
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 200 and image.shape[1] > 400 and image[..., :3].std() > 0.05  # drawn, not blank


def test_files_that_are_not_results_fail_in_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert main(["bench", "plot", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"nsa: error: no results file '{missing}': pass a JSON that nsa bench attention, decode or train wrote into "
        "its --out folder (e.g. nsa bench attention --out results/, then results/attention.json)\n")
    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": [')
    assert main(["bench", "plot", str(broken)]) != 0
    assert "not valid JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"loss": 1.0}]}))
    with pytest.raises(UserError, match="not results of nsa bench"):
        plot.plot_file(other)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": [{"shape": "m7c", "T": 2048, "nsa_fwd_ms": None}]}))
    with pytest.raises(UserError, match="nothing to plot"):
        plot.plot_file(empty)


def test_a_bench_without_numbers_writes_its_results_and_no_picture(tmp_path):
    """The benches call picture(): a run whose every call failed (or that ran one model only) keeps its CSV/JSON
    and simply has no PNG, instead of ending in an error after the measurements."""
    assert plot.picture([{"attention": "nsa", "context": 4096, "batch": 1, "step_ms": 1.0}], {}, tmp_path / "d.png") == ()
    assert not (tmp_path / "d.png").exists()
    assert plot.picture(TRAIN, {}, tmp_path / "t.png") == (tmp_path / "t.png",)
    assert (tmp_path / "t.png").stat().st_size > 10_000
