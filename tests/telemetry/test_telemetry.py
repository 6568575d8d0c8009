"""Run artifacts, the stall watchdog, SIGUSR1 dumps, the HALT file, gate warnings and the report of a real run."""

import csv
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from nsa.config import load_config
from nsa.telemetry.gate_watch import GateWatch
from nsa.telemetry.heartbeat import Heartbeat
from nsa.telemetry.report import render_report
from nsa.telemetry.run_files import read_jsonl as read_events
from nsa.telemetry.watchdog import Watchdog
from nsa.train import checkpoint
from nsa.train.loop import Trainer, train
from nsa.train.stop import LAG

FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=64", "train.batch_size=4", "train.steps=20", "train.warmup_steps=4",
    "train.eval_every=10", "train.eval_batches=2", "train.log_every=5", "train.sample_tokens=0",
    "train.progress=false", "telemetry.health_every=5",
]


def events(run: Path, rank: int = 0) -> list[dict]:
    return read_events(run / f"heartbeat_rank{rank}.jsonl")


def test_a_tiny_run_leaves_complete_artifacts_and_a_report(tmp_path):
    cfg = load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "checkpoint.every=10"])
    train(cfg)
    run = tmp_path / "r"
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 5, 10, 15, 20]
    assert all(0 <= float(r["data_wait"]) <= 1 for r in rows) and rows[0]["mem_gb"] == ""  # no GPU memory on CPU
    env = json.loads((run / "env.json").read_text())
    assert env["config"]["train"]["steps"] == 20 and env["versions"]["torch"] == torch.__version__
    assert env["world_size"] == 1 and env["git"]
    names = [e["event"] for e in events(run)]
    assert names[0] == "boot" and names[-1] == "done"
    assert names.count("step") == 5 and names.count("eval") == 2 and names.count("checkpoint") == 1
    stats = read_events(run / "nsa_stats.jsonl")
    assert [s["step"] for s in stats] == [1, 5, 10, 15, 20] and len(stats[0]["layers"]) == 2
    assert all(abs(sum(layer["gate_mean"]) - 1.5) < 0.5 for layer in stats[-1]["layers"])  # gates start near 0.5
    assert list((run / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"

    report = render_report(run)
    text = report.read_text()
    assert "loss.png" in text and "gates.png" in text
    for image in ("loss.png", "throughput.png", "gates.png", "selection.png"):
        assert (report.parent / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image


def _slow_step_at(monkeypatch, step: int, seconds: float):
    real = Trainer.train_step

    def train_step(self):
        out = real(self)
        if self.step == step:
            time.sleep(seconds)  # the "stuck" training thread
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_a_stalled_step_dumps_every_threads_stack_and_records_a_stall(tmp_path, monkeypatch):
    # A 1 s limit against a 2.5 s stall. Only the injected episode is counted: on a loaded 2-core CI machine the
    # first step (lazy init) once took 1.6 s and was, correctly, a stall of its own at step 0.
    _slow_step_at(monkeypatch, 3, 2.5)
    cfg = load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=6",
                                    "telemetry.stall_timeout_s=1.0"])
    train(cfg)
    run = tmp_path / "r"
    stalls = [e for e in events(run) if e["event"] == "stall" and e["step"] == 2]
    assert len(stalls) == 1 and stalls[0]["seconds"] >= 1.0  # one record for one 2.5 s episode
    dump = (run / "stacks_rank0.txt").read_text()
    assert "no step finished for" in dump and "line" in dump and " in train_step" in dump  # the stuck frame
    assert [e["event"] for e in events(run)][-1] == "done"  # the run went on


def test_watchdog_reports_one_stall_per_episode_and_sigusr1_dumps_on_demand(tmp_path):
    beat = Heartbeat(tmp_path / "hb.jsonl", 0)
    dog = Watchdog(tmp_path, 0, 0.2, beat)
    dog.install_signal_handler()
    try:
        dog.progress(7)
        time.sleep(0.9)  # one stall, however many polls see it
        assert dog.stalls == 1
        dog.progress(8)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the Python-level handler runs between bytecodes
    finally:
        dog.close()
        beat.close()
    got = read_events(tmp_path / "hb.jsonl")
    assert [e["event"] for e in got] == ["stall", "dump"] and got[0]["step"] == 7 and got[1]["step"] == 8
    dump = (tmp_path / "stacks_rank0.txt").read_text()
    assert dump.count("no step finished") == 1
    assert dump.count("test_watchdog_reports_one_stall") >= 2  # the stall dump and the SIGUSR1 dump
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None) or callable(signal.getsignal(signal.SIGUSR1))


def test_a_halt_file_stops_the_run_with_a_checkpoint_that_resumes_exactly(tmp_path, monkeypatch):
    base = FAST + [f"train.out_dir={tmp_path}", "train.log_every=1", "train.eval_every=0", "train.steps=14"]
    full = train(load_config(None, base + ["train.run_name=full"]))

    real = Trainer.train_step

    def train_step(self):
        out = real(self)
        if self.step == 5 and not hasattr(self, "_halted_once"):
            self._halted_once = True
            (self.run_dir / "HALT").touch()
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)
    first = train(load_config(None, base + ["train.run_name=cut"]))
    stopped = 5 + LAG
    assert first.checkpoint.name == f"step_{stopped:08d}" and checkpoint.read_meta(first.checkpoint)["step"] == stopped
    assert not (tmp_path / "cut" / "HALT").exists()
    halt = [e for e in events(tmp_path / "cut") if e["event"] == "halt"]
    assert halt and halt[0]["reason"] == "HALT file" and halt[0]["step"] == stopped
    assert max(first.losses) == stopped

    monkeypatch.setattr(Trainer, "train_step", real)
    second = train(load_config(None, base + ["train.run_name=cut"]))
    assert min(second.losses) == stopped + 1 and max(second.losses) == 14
    for step in range(stopped + 1, 15):
        assert second.losses[step] == full.losses[step], step


def test_logging_does_no_host_sync_on_non_logging_steps(tmp_path, monkeypatch):
    calls = []
    real_item = torch.Tensor.item

    def item(self):
        caller = sys._getframe(1).f_code.co_filename  # torch's CPU optimizer reads its own step counters
        if f"{os.sep}nsa{os.sep}" in caller:
            calls.append(current["step"])
        return real_item(self)

    real = Trainer.train_step
    current = {"step": 0}

    def train_step(self):
        out = real(self)
        current["step"] = self.step
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(torch.Tensor, "item", item)
    train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "train.eval_every=0",
                                    "train.log_every=5", "train.steps=10"]))
    synced_steps = set(calls) - {0}
    assert synced_steps <= {1, 5, 10}, sorted(synced_steps)
    assert {1, 5, 10} <= synced_steps


def _record(means):
    return {"layers": [{"gate_mean": m} for m in means]}


def test_gate_watch_warns_once_about_collapsed_and_flat_gates():
    watch = GateWatch(collapse=0.02, flat_steps=100)
    assert watch.check(0, _record([[0.5, 0.5, 0.5], [0.5, 0.4, 0.6]])) == []
    warnings = watch.check(10, _record([[0.5, 0.5, 0.5], [0.5, 0.01, 0.6]]))
    assert len(warnings) == 1 and "layer 1: the selected gate collapsed to 0.010" in warnings[0]
    assert watch.check(20, _record([[0.5, 0.5, 0.5], [0.5, 0.01, 0.6]])) == []  # given once
    assert watch.check(109, _record([[0.5, 0.5, 0.5], [0.5, 0.01, 0.6]])) == []  # flat for 99 steps only
    flat = watch.check(111, _record([[0.5, 0.5, 0.5], [0.5, 0.01, 0.6]]))
    assert len(flat) == 1 and "no gate mean moved" in flat[0] and "steps 10-111" in flat[0]

    moving = GateWatch(collapse=0.02, flat_steps=100)
    for step in range(0, 500, 50):
        assert moving.check(step, _record([[0.5 + step * 1e-4, 0.5, 0.5]])) == []


@pytest.mark.parametrize("bad", ["telemetry.stall_timeout_s=-1", "telemetry.health_tokens=0"])
def test_bad_telemetry_settings_are_config_errors(bad):
    from nsa.errors import ConfigError

    with pytest.raises(ConfigError, match="telemetry"):
        load_config(None, [bad])
