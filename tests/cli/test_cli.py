"""Command-line parsing: key=value overrides may come before or after the flags."""

import pytest

from nsa.cli import parse_args


def test_overrides_may_follow_the_flags():
    ns = parse_args(["bench", "train", "model.dim=64", "--steps", "2", "parallel.mode=ddp", "--warmup", "1",
                     "train.lr=0.1"])
    assert ns.args == ["model.dim=64", "parallel.mode=ddp", "train.lr=0.1"]
    assert (ns.steps, ns.warmup) == (2, 1)


def test_eval_and_convert_overrides_may_follow_the_flags():
    ns = parse_args(["eval", "runs/x", "--tasks", "none", "data.source=embedded", "--samples", "4", "data.seed=2"])
    assert ns.overrides == ["data.source=embedded", "data.seed=2"] and (ns.tasks, ns.samples) == ("none", 4)
    ns = parse_args(["convert", "in", "out", "model.nsa.window=64"])
    assert ns.overrides == ["model.nsa.window=64"]


def test_unknown_flags_are_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["bench", "train", "--stepz", "2"])
    assert e.value.code == 2
    assert "unrecognized arguments: --stepz" in capsys.readouterr().err


def test_a_command_without_config_arguments_refuses_stray_ones(capsys):
    with pytest.raises(SystemExit) as e:  # `nsa bench attention` takes no config
        parse_args(["bench", "attention", "--no-fla", "x=1"])
    assert e.value.code == 2 and "unrecognized arguments: x=1" in capsys.readouterr().err
