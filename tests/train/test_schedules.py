"""Learning-rate schedules: their values at chosen steps, and exact resume in the middle of a decay."""

import csv
import math

import pytest

from nsa.config import load_config
from nsa.errors import ConfigError
from nsa.telemetry.run_files import read_jsonl
from nsa.train.config import TrainConfig
from nsa.train.loop import train
from nsa.train.optim import lr_factor, wsd_decay_start
from nsa.train.resume_rules import APPLIED, resume_rule

FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=64", "train.batch_size=4", "train.steps=12", "train.warmup_steps=2",
    "train.eval_every=0", "train.log_every=1", "train.sample_tokens=0", "train.progress=false",
    "telemetry.health_every=0", "train.decay_fraction=0.5",
]


def factors(schedule: str, steps: int = 100, warmup: int = 10, **kw) -> list[float]:
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, min_lr_ratio=0.1, schedule=schedule, **kw)
    return [lr_factor(s, cfg) for s in range(steps + 1)]


def test_cosine_is_the_default_and_keeps_its_values():
    assert TrainConfig().schedule == "cosine"
    f = factors("cosine")
    # The formula the cosine schedule has always used: the numbers of existing runs must not move.
    for s in range(10, 101):
        assert f[s] == 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 10) / 90)))
    assert f[9] == 1.0 and f[55] == pytest.approx(0.55) and f[100] == pytest.approx(0.1)


def test_linear_warms_up_then_falls_in_a_straight_line_to_the_floor():
    f = factors("linear")
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])  # warmup ends at 1.0 on step 9
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.55)  # mid-decay
    assert f[99] == pytest.approx(0.1 + 0.9 / 90) and f[100] == pytest.approx(0.1)  # last step, floor
    diffs = [a - b for a, b in zip(f[10:], f[11:])]
    assert diffs == pytest.approx([0.9 / 90] * 90)


def test_wsd_holds_the_peak_then_decays_along_one_minus_sqrt_over_the_last_fraction():
    f = factors("wsd", decay_fraction=0.2)
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert set(f[10:81]) == {1.0}  # stable until the decay starts at step 80 (its first factor is still 1)
    assert f[85] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.25)))  # 0.55
    assert f[90] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert f[99] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.95))) and f[100] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(f[80:], f[81:]))


def test_wsd_never_decays_inside_the_warmup():
    cfg = TrainConfig(steps=20, warmup_steps=10, schedule="wsd", decay_fraction=0.9)
    assert wsd_decay_start(cfg) == 10
    assert [lr_factor(s, cfg) for s in (9, 10)] == [1.0, 1.0] and lr_factor(20, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("bad", ["train.decay_fraction=0", "train.decay_fraction=1.5", "train.schedule=step"])
def test_bad_schedule_settings_are_config_errors(bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        load_config(None, [bad])


def lr_column(run) -> dict[int, float]:
    return {int(r["step"]): float(r["lr"]) for r in csv.DictReader(open(run / "metrics.csv"))}


@pytest.mark.parametrize("schedule", ["wsd", "linear"])
def test_a_run_stopped_mid_decay_resumes_exactly(tmp_path, schedule):
    common = FAST + [f"train.out_dir={tmp_path}", f"train.schedule={schedule}"]
    full = train(load_config(None, common + ["train.run_name=full"]))
    part = train(load_config(None, common + ["train.run_name=cut", "train.stop_after=8"]))  # wsd decays from 6
    rest = train(load_config(None, common + ["train.run_name=cut"]))
    assert sorted(rest.losses) == list(range(9, 13))
    assert {**part.losses, **rest.losses} == full.losses  # bit-identical
    lrs = lr_column(tmp_path / "cut")
    assert lrs == lr_column(tmp_path / "full") and sorted(lrs) == list(range(1, 13))
    cfg = load_config(None, common).train
    assert lrs[10] == pytest.approx(cfg.lr * lr_factor(10, cfg), rel=1e-5)
    assert lrs[12] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-5)


def test_a_changed_schedule_on_resume_is_applied_from_the_resumed_step(tmp_path):
    assert resume_rule("train.schedule") == APPLIED and resume_rule("train.decay_fraction") == APPLIED
    common = FAST + [f"train.out_dir={tmp_path}", "train.run_name=r"]
    train(load_config(None, common + ["train.stop_after=4"]))  # cosine
    train(load_config(None, common + ["train.schedule=wsd"]))  # cooldown: stable to step 6, then 1-sqrt
    lrs = lr_column(tmp_path / "r")
    cosine, wsd = (load_config(None, common + [f"train.schedule={s}"]).train for s in ("cosine", "wsd"))
    assert lrs[4] == pytest.approx(cosine.lr * lr_factor(4, cosine), rel=1e-5)
    for step in range(5, 13):
        assert lrs[step] == pytest.approx(wsd.lr * lr_factor(step, wsd), rel=1e-5), step
    resume = [e for e in read_jsonl(tmp_path / "r" / "heartbeat_rank0.jsonl") if e["event"] == "resume"]
    assert resume[0]["changed"]["train.schedule"] == ["cosine", "wsd"]
