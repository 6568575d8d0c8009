"""`nsa report`: plots and report.md from a fake run folder (no training, no GPU)."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nsa.errors import UserError
from nsa.telemetry.report import (ATTENTION_OFF, LengthLoss, collapse_spans, describe_lowest_head, describe_span,
                                  gate_warnings, length_table, longest_collapse, loss_by_length, lowest_head_gate,
                                  render_report, stale_ranks, summary_markdown)
from nsa.telemetry.run_files import layer_series, load_run

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIELDS = ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "mem_gb", "data_wait"]
VAL = {20: 4.5, 40: 3.25, 60: 3.5}  # the best is at step 40, not the last eval


def write_metrics(run: Path, fields=FIELDS, steps=range(10, 81, 10), with_mem=True) -> None:
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for s in steps:
            w.writerow({
                "step": s, "tokens": s * 4096, "loss": 8.0 * math.exp(-s / 25) + 2.0, "val_loss": VAL.get(s, ""),
                "lr": 1e-3 * min(1.0, s / 20), "grad_norm": 1.0, "tokens_per_s": 1000 + 10 * s, "elapsed_s": s * 0.5,
                "mem_gb": 10.0 + s / 100 if with_mem else "", "data_wait": 0.05,
            })


def stats_record(step: int, n_layers: int = 2) -> dict:
    layers = []
    for layer in range(n_layers):
        if layer == 1:  # collapsed onto the window branch, and never moving
            mean = [0.005, 0.01, 0.99]
        else:
            mean = [0.3 + step / 1000, 0.3, 0.4 - step / 1000]
        layers.append({
            "layer": layer, "gate_mean": mean, "gate_std": [0.05, 0.05, 0.05], "gate_entropy": 0.9,
            "sel_distance_mean": 100.0 + step, "sel_forced_share": 0.4, "sel_concentration": 0.6,
        })
    edges = [0, 16, 64, 256, 1024, 4096]
    return {"step": step, "layers": layers, "distance_edges": edges,
            "distance_counts": [[5, 10, 20, 8, 2] for _ in range(n_layers)]}


def write_jsonl(path: Path, records: list[dict], partial_tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial_tail)


def heartbeat(t: float, event: str, rank: int, step: int, **extra) -> dict:
    return {"time": 1_700_000_000.0 + t, "event": event, "rank": rank, "step": step, **extra}


@pytest.fixture
def nsa_run(tmp_path) -> Path:
    run = tmp_path / "nsa-run"
    run.mkdir()
    write_metrics(run)
    write_jsonl(run / "nsa_stats.jsonl", [stats_record(s) for s in (20, 40, 60, 80)])
    beats0 = [heartbeat(0, "boot", 0, 0)] + [heartbeat(10 * i, "step", 0, 10 * i) for i in range(1, 40)]
    beats1 = [heartbeat(0, "boot", 1, 0)] + [heartbeat(10 * i, "step", 1, 10 * i) for i in range(1, 8)]
    beats1 += [heartbeat(80, "stall", 1, 70, message="no step for 120 s (waiting for data?)")] * 2
    write_jsonl(run / "heartbeat_rank0.jsonl", beats0)
    write_jsonl(run / "heartbeat_rank1.jsonl", beats1)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 200}}))
    (run / "env.json").write_text(json.dumps({"versions": {"torch": "2.13.0"}, "gpus": ["NVIDIA H200"] * 2,
                                              "git": "abcdef1234567890", "command": "nsa train", "config": {}}))
    return run


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 1024, (path, len(data))


def test_nsa_run_renders_every_plot_and_a_summary(nsa_run):
    report = render_report(nsa_run)
    assert report == nsa_run / "report" / "report.md"
    for name in ("loss.png", "throughput.png", "lr.png", "memory.png", "gates.png", "selection.png"):
        assert_png(report.parent / name)
    text = report.read_text()
    assert "# Run report: nsa-run" in text
    assert "| steps | 80 / 200 (40%) |" in text
    assert "| best val loss | 3.2500 (step 40) |" in text
    assert "| tokens seen | 327.68k |" in text
    assert "| peak memory | 10.80 GB |" in text
    assert "layer 1: compressed gate collapsed" in text and "layer 1: window gate collapsed" in text
    assert "layer 0:" not in text.split("Gate warnings")[1].split("##")[0]  # the healthy layer is not flagged
    assert "layer 1: gate means flat" in text
    # Two identical stall events are one line, with their message.
    assert text.count("**stall**") == 1 and "no step for 120 s (waiting for data?)" in text and "(2x)" in text
    assert "rank 1 is stale" in text and "rank 0 is stale" not in text
    assert "2x NVIDIA H200" in text
    for name in ("loss.png", "gates.png", "selection.png", "memory.png"):
        assert f"![]({name})" in text


def test_dense_run_without_memory_or_extras(tmp_path):
    run = tmp_path / "dense"
    run.mkdir()
    old_fields = [f for f in FIELDS if f not in ("mem_gb", "data_wait")]  # an older trainer's columns
    write_metrics(run, fields=old_fields)
    out = tmp_path / "elsewhere"
    report = render_report(run, out)
    assert report == out / "report.md"
    assert sorted(p.name for p in out.glob("*.png")) == ["loss.png", "lr.png", "throughput.png"]
    text = report.read_text()
    assert "No nsa_stats.jsonl" in text and "gates.png" not in text.split("Not drawn")[0]
    assert "memory.png: no mem_gb values" in text
    assert "| peak memory | not logged |" in text
    assert "| steps | 80 |" in text  # no config.yaml: no total


def test_a_rerender_removes_images_it_no_longer_draws(tmp_path):
    write_metrics(tmp_path)
    assert (render_report(tmp_path).parent / "memory.png").exists()
    write_metrics(tmp_path, with_mem=False)
    report = render_report(tmp_path)
    assert not (report.parent / "memory.png").exists() and (report.parent / "loss.png").exists()


def test_half_written_last_lines_are_ignored(nsa_run):
    with open(nsa_run / "metrics.csv", "a") as f:
        f.write("90,368640,1.0")  # the trainer is mid-row
    write_jsonl(nsa_run / "nsa_stats.jsonl", [stats_record(s) for s in (20, 40)], partial_tail='{"step": 60, "lay')
    with open(nsa_run / "heartbeat_rank0.jsonl", "a") as f:
        f.write('{"time": 17000')
    run = load_run(nsa_run)
    assert [int(r["step"]) for r in run.metrics][-1] == 80
    assert [r["step"] for r in run.stats] == [20, 40]
    text = summary_markdown(run, layer_series(run.stats), [])  # the text alone: the plots are tested above
    assert "| last train loss | 2.3261 (step 80) |" in text and "Gates at the last record (step 40)" in text


def test_resumed_runs_keep_the_last_record_per_step(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    write_metrics(run)
    first, again = stats_record(40), stats_record(40)
    again["layers"][0]["gate_mean"] = [0.2, 0.2, 0.6]
    write_jsonl(run / "nsa_stats.jsonl", [stats_record(20), first, again])
    series = layer_series(load_run(run).stats)
    assert series[0].steps.tolist() == [20, 40] and series[0].gate_mean[-1].tolist() == [0.2, 0.2, 0.6]


def test_gate_warnings_thresholds():
    healthy, moving = layer_series([stats_record(10), stats_record(20)])
    assert gate_warnings([healthy]) == []
    assert any("flat" in w for w in gate_warnings([moving]))
    assert len([w for w in gate_warnings([moving]) if "collapsed" in w]) == 3  # 0.005, 0.01 and 0.99


def test_layers_whose_gates_end_where_they_started_are_named_once_enough_records_exist():
    def record(step, moved_layer_gates, entropy):
        return {"step": step, "layers": [
            {"layer": 0, "gate_mean": moved_layer_gates, "gate_entropy": 0.6},
            {"layer": 1, "gate_mean": [0.34, 0.33, 0.33], "gate_entropy": entropy},
            {"layer": 2, "gate_mean": [0.36, 0.30, 0.34], "gate_entropy": 1.09}]}

    start = {"step": 1, "layers": [{"layer": i, "gate_mean": [1 / 3] * 3, "gate_entropy": 1.098} for i in range(3)]}
    # Layers 1 and 2 wander and come back; layer 0 leaves for good. The wandering keeps them off the "flat" warning.
    stats = [start] + [record(50 * k, [0.1, 0.8, 0.1], 1.05 if k % 2 else 0.7) for k in range(1, 10)]
    warnings = gate_warnings(layer_series(stats))
    assert [w for w in warnings if "where they started" in w] == [
        "layers 1, 2: gates where they started (every branch's mean within 0.05 of step 1's, entropy within 0.1 "
        "nats) at step 450: does the task use them? (nsa eval --ablate-attention 1,2)"]
    # A per-token spread that moved (entropy 0.7 against 1.098) is not where it started, even at a third on average.
    stats[-1]["layers"][1]["gate_entropy"] = 0.7
    assert "layer 2: gates where they started" in " ".join(gate_warnings(layer_series(stats)))
    # Too few records to tell.
    assert not [w for w in gate_warnings(layer_series(stats[:5])) if "where they started" in w]


def test_collapse_spans_say_how_long_each_gate_stayed_collapsed():
    gates = {100: [0.3, 0.3, 0.3], 200: [0.01, 0.4, 0.01], 300: [0.01, 0.01, 0.01], 400: [0.01, 0.3, 0.01],
             500: [0.3, 0.3, 0.01], 600: [0.3, 0.99, 0.01]}
    stats = [{"step": step, "layers": [{"layer": 0, "gate_mean": g}]} for step, g in gates.items()]
    spans = collapse_spans(layer_series(stats))
    assert [(sp.what, sp.start, sp.end) for sp in spans] == [
        ("compressed", 200, 400), ("selected", 300, 300), ("selected", 600, 600), ("window", 200, 600),
        (ATTENTION_OFF, 300, 300)]
    assert describe_span(longest_collapse(spans)) == "layer 0, window, steps 200-600 (400 steps)"
    assert longest_collapse(spans, ATTENTION_OFF).steps == 0
    healthy = collapse_spans(layer_series([{"step": 10, "layers": [{"layer": 0, "gate_mean": [0.3, 0.3, 0.3]}]}]))
    assert healthy == [] and describe_span(longest_collapse(healthy)) == "none"


def test_the_lowest_head_gate_is_found_over_layers_and_records_and_counted_where_under_the_collapse_bound():
    layer = lambda i, head_min: {"layer": i, "gate_mean": [0.3, 0.3, 0.4], "gate_head_min": head_min}  # noqa: E731
    stats = [{"step": 100, "layers": [layer(0, [0.2, 0.1, 0.3]), layer(1, [0.25, 0.2, 0.3])]},
             {"step": 200, "layers": [layer(0, [0.2, 0.1, 0.3]), layer(1, [0.25, 0.005, 0.3])]},
             {"step": 300, "layers": [layer(0, [0.01, 0.1, 0.3]), layer(1, [0.25, 0.015, 0.3])]},
             {"step": 400, "layers": [layer(0, [0.2, 0.1, 0.3]), layer(1, [0.25, 0.2, 0.3])]}]
    # Layer means never go under 0.02: only the heads show the two records with a collapse.
    assert collapse_spans(layer_series(stats)) == []
    lowest = lowest_head_gate(layer_series(stats))
    assert lowest == (0.005, 200, 1, "selected", 2, 4)
    assert describe_lowest_head(lowest).endswith("0.0050 at step 200 (layer 1, selected); records with a head under "
                                                 "0.02: 2 of 4.")
    older = [{"step": 100, "layers": [{"layer": 0, "gate_mean": [0.3, 0.3, 0.4]}]}]  # a trainer without head means
    assert lowest_head_gate(layer_series(older)) is None


# (step, seq_len, loss): a run whose 64k steps are still missed at the end while its 4k steps are solved. Step 50
# is an older trainer's row (no seq_len), step 80 a non-finite loss: both are left out, so 10 rows count and the
# last third is their last 4 (steps 70-110). 16k occurs only before it.
LENGTH_ROWS = [(10, 4096, 2.0), (15, 16384, 0.9), (20, 65536, 1.8), (30, 4096, 0.002), (40, 65536, 1.2),
               (50, None, 0.5), (60, 4096, 0.001), (70, 65536, 0.001), (80, 4096, math.nan), (90, 65536, 1.6),
               (100, 4096, 0.001), (110, 65536, 0.003)]


def length_rows(rows=LENGTH_ROWS) -> list[dict]:
    return [{"step": step, "seq_len": length, "loss": loss} for step, length, loss in rows]


def test_loss_by_length_counts_the_steps_over_the_threshold_per_length():
    assert loss_by_length(length_rows()) == [
        LengthLoss(4096, 4, 0.25, 0.0015), LengthLoss(16384, 1, 1.0, 0.9), LengthLoss(65536, 5, 0.6, 1.2)]
    table = length_table(length_rows())
    assert (table.first, table.last) == (70, 110)
    assert table.tail == {4096: LengthLoss(4096, 1, 0.0, 0.001), 65536: LengthLoss(65536, 3, 1 / 3, 0.003)}
    assert table.run == loss_by_length(length_rows())
    # A threshold of 0.05 nats: 0.049 is a solved step, 0.051 a missed one.
    assert [s.missed for s in loss_by_length(length_rows([(1, 256, 0.049), (2, 256, 0.051)]))] == [0.5]
    # One length (or none recorded, as in an older trainer's file): no table.
    assert length_table(length_rows([(1, 256, 1.0), (2, 256, 0.5), (3, None, 0.1)])) is None
    assert length_table([{"step": 1, "loss": 1.0}]) is None


def test_the_report_prints_and_writes_the_loss_by_length_of_a_mixed_length_run(tmp_path, capsys):
    fields = FIELDS + ["seq_len"]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows({"step": step, "tokens": step * 65536, "loss": loss, "seq_len": "" if length is None else length}
                    for step, length, loss in LENGTH_ROWS)
    text = render_report(tmp_path).read_text()
    section = text.split("## Loss by sequence length")[1].split("## Health")[0]
    assert "steps 70-110" in section
    assert ("| length | steps (end) | loss > 0.05 (end) | median (end) | steps (all) | loss > 0.05 (all) | "
            "median (all) |") in section
    assert "| 4,096 | 1 | 0% | 0.001 | 4 | 25% | 0.0015 |" in section
    assert "| 16,384 | 0 | - | - | 1 | 100% | 0.9 |" in section
    assert "| 65,536 | 3 | 33% | 0.003 | 5 | 60% | 1.2 |" in section
    printed = capsys.readouterr().out
    assert "loss by sequence length" in printed and "steps 70-110" in printed
    assert any(line.split() == ["65,536", "3", "33%", "0.003", "5", "60%", "1.2"] for line in printed.splitlines())


def test_a_metrics_file_without_seq_len_reports_without_the_length_table(tmp_path, capsys):
    write_metrics(tmp_path)  # an older trainer's columns: no seq_len
    text = render_report(tmp_path).read_text()
    assert "| last train loss |" in text and "Loss by sequence length" not in text
    assert "loss by sequence length" not in capsys.readouterr().out
    with open(tmp_path / "metrics.csv", "w", newline="") as f:  # one length: nothing a length table would add
        w = csv.DictWriter(f, fieldnames=FIELDS + ["seq_len"], extrasaction="ignore")
        w.writeheader()
        w.writerows({"step": s, "loss": 1.0 / s, "seq_len": 4096} for s in range(1, 10))
    assert "Loss by sequence length" not in render_report(tmp_path).read_text()


def test_stale_ranks_scale_with_the_heartbeat_rhythm():
    beats = [heartbeat(t, "step", 0, t) for t in range(0, 3000, 300)] + [heartbeat(2100, "step", 1, 2100)]
    assert stale_ranks(beats) == []  # 600 s behind, but heartbeats come every 300 s
    beats.append(heartbeat(0, "step", 1, 0))
    beats.sort(key=lambda r: r["time"])
    assert stale_ranks(beats, factor=1.0) == [(1, 600.0)]
    assert stale_ranks([heartbeat(0, "step", 0, 0), heartbeat(900, "done", 0, 1), heartbeat(0, "done", 1, 1)]) == []


def test_empty_metrics_still_reports(tmp_path):
    run = tmp_path / "just-started"
    run.mkdir()
    (run / "metrics.csv").write_text(",".join(FIELDS) + "\n")
    text = render_report(run).read_text()
    assert "no metrics rows logged yet" in text
    assert not list((run / "report").glob("*.png"))


def test_bad_folders_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        render_report(tmp_path / "missing")
    with pytest.raises(UserError, match="no metrics.csv"):
        render_report(tmp_path)


def nsa_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsa", "report", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli(nsa_run, tmp_path):
    out = nsa_cli(str(nsa_run), "--out", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "rep" / "report.md") in out.stdout and "gates.png" in out.stdout
    assert (tmp_path / "rep" / "report.md").exists()

    bad = nsa_cli(str(tmp_path / "nope"))
    assert bad.returncode != 0
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("nsa: error: run folder") and "does not exist" in bad.stderr
