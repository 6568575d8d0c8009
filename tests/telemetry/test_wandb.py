"""telemetry.wandb: the same scalars as TensorBoard at the same steps, one W&B run across resumes, rank 0 only,
and a one-line error without the package. A stand-in `wandb` module records the calls, so the tests need neither
the package nor the W&B servers."""

import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa.cli import main
from nsa.config import load_config
from nsa.telemetry.run_log import RunLog
from nsa.train.loop import train

FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=64", "train.batch_size=4", "train.steps=12", "train.warmup_steps=2",
    "train.eval_every=6", "train.eval_batches=2", "train.log_every=3", "train.sample_tokens=0",
    "train.progress=false", "telemetry.health_every=3", "telemetry.wandb=true", "telemetry.wandb_mode=offline",
]


class FakeRun:
    def __init__(self, kwargs: dict):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((step, dict(scalars)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def tensorboard_scalars(run_dir) -> set[tuple[str, int]]:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def logged(run: FakeRun) -> set[tuple[str, int]]:
    return {(name, step) for step, scalars in run.logged for name in scalars}


def test_wandb_receives_the_tensorboard_scalars_at_the_same_steps(tmp_path, fake_wandb):
    train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r"]))
    (run,) = fake_wandb.runs
    assert run.finished
    assert run.kwargs["project"] == "nsa" and run.kwargs["name"] == "r" and run.kwargs["mode"] == "offline"
    assert run.kwargs["config"]["telemetry"]["wandb"] is True
    scalars = logged(run)
    assert scalars == tensorboard_scalars(tmp_path / "r")
    names = {name for name, _ in scalars}
    assert {"train/loss", "train/lr", "val/loss", "gates/layer0_sel", "selection/layer1_distance"} <= names
    assert {step for name, step in scalars if name == "train/loss"} == {1, 3, 6, 9, 12}


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, fake_wandb):
    common = FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "telemetry.wandb_run_name=shown"]
    train(load_config(None, common + ["train.stop_after=6"]))
    train(load_config(None, common))
    first, second = fake_wandb.runs
    stored = (tmp_path / "r" / "wandb_id").read_text().strip()
    assert first.kwargs["id"] == second.kwargs["id"] == stored and second.kwargs["resume"] == "allow"
    assert first.kwargs["name"] == "shown"
    assert max(step for step, _ in first.logged) == 6 and min(step for step, _ in second.logged) == 9


def test_only_rank_0_starts_a_wandb_run(tmp_path, fake_wandb):
    log = RunLog(tmp_path, 1, False, {}, 2, 0, tensorboard=False,
                 wandb=dict(project="p", name="", mode="offline"))
    log.step({"step": 1, "loss": 1.0}, {})
    log.close()
    assert fake_wandb.runs == [] and not (tmp_path / "wandb_id").exists()


def test_without_the_wandb_package_training_stops_with_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    assert main(["train", *FAST, f"train.out_dir={tmp_path}", "train.run_name=r"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsa: error: telemetry.wandb=true needs the wandb package: pip install -e \".[wandb]\"")
    assert err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()  # nothing was trained, so no run folder is left behind
