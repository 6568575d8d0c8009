"""End-to-end training on the embedded corpus, run artifacts, checkpoints and CLI errors."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nsa.cli import main
from nsa.config import load_config
from nsa.model import Transformer
from nsa.model.config import ModelConfig
from nsa.train import checkpoint
from nsa.train.loop import train
from nsa.typed_config import from_dict

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=64", "train.batch_size=8", "train.steps=80", "train.warmup_steps=10",
    "train.eval_every=40", "train.eval_batches=4", "train.log_every=10", "train.sample_tokens=40",
    "train.progress=false",
]


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_short_run_lowers_the_loss_and_leaves_artifacts(tmp_path, attention):
    cfg = load_config(None, FAST + [f"model.attention={attention}", f"train.out_dir={tmp_path}", "train.run_name=r"])
    result = train(cfg)
    assert result.last_loss < result.first_loss - 1.5, (result.first_loss, result.last_loss)
    assert result.val_loss is not None and result.val_loss < result.first_loss - 1.0
    run = tmp_path / "r"
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert list(rows[0]) == ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"]
    assert [int(r["step"]) for r in rows] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    assert rows[3]["val_loss"] == "" and float(rows[4]["val_loss"]) > 0
    saved = yaml.safe_load(open(run / "config.yaml"))
    assert saved["model"]["vocab_size"] == 320 and saved["train"]["steps"] == 80
    assert result.sample.startswith("And God said") and len(result.sample) > len("And God said")

    # The final checkpoint rebuilds the same model.
    state = checkpoint.load(result.checkpoint)
    assert state["step"] == 80
    model = Transformer(from_dict(ModelConfig, state["config"]["model"]))
    model.load_state_dict(state["model"])
    tokens = torch.randint(0, 256, (1, 64))
    assert torch.isfinite(model(tokens[:, :-1], tokens[:, 1:]))


def test_atomic_save_keeps_the_previous_checkpoint_when_a_save_fails(tmp_path):
    path = tmp_path / "ck.pt"
    checkpoint.save_atomic({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic({"step": 2, "bad": Unpicklable()}, path)
    assert checkpoint.load(path)["step"] == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "train.stpes=3"], "nsa: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
        (["train", "missing.yaml"], "nsa: error: config file 'missing.yaml' not found"),
        (["train", "nosuchpreset"], "nsa: error: config 'nosuchpreset' not found"),
        (["train", "data.source=text", "data.path=/no/such/dir"], "nsa: error: data.path '/no/such/dir' does not exist"),
        (["train", "train.device=cuda:0"] if not torch.cuda.is_available() else ["train", "train.device=tpu"], "nsa: error: train.device="),
    ],
)
def test_cli_user_errors_are_one_line_with_exit_code_2(args, message, capsys, tmp_path):
    assert main(args + [f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_python_dash_m_nsa_prints_the_resolved_config():
    out = subprocess.run(
        [sys.executable, "-m", "nsa", "config", str(CONFIGS / "m7c.yaml"), "train.steps=3"],
        capture_output=True, text=True, check=True,
    ).stdout
    cfg = yaml.safe_load(out)
    assert cfg["model"]["dim"] == 768 and cfg["train"]["steps"] == 3


def test_gradient_accumulation_matches_one_large_batch():
    from nsa.data.packing import ShuffledBatches, build_splits
    from nsa.data.tokenizers import ByteTokenizer
    from nsa.train.loop import autocast_context, resolve_vocab, train_step
    from nsa.train.optim import build_optimizer, build_scheduler

    results = []
    for batch, accum in ((8, 1), (4, 2)):
        cfg = resolve_vocab(load_config(None, FAST + [f"train.batch_size={batch}", f"train.grad_accum={accum}"]), ByteTokenizer())
        windows, _ = build_splits(cfg.data, ByteTokenizer(), cfg.train.seq_len)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        opt = build_optimizer(model, cfg.train, torch.device("cpu"))
        sched = build_scheduler(opt, cfg.train)
        sampler = ShuffledBatches(len(windows), batch, seed=3)
        loss, norm = train_step(model, opt, sched, windows, sampler, cfg, torch.device("cpu"),
                                lambda: autocast_context("fp32", torch.device("cpu")))
        results.append((loss, norm, [p.detach().clone() for p in model.parameters()]))
    (l1, n1, p1), (l2, n2, p2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(n1, n2)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b)


def test_lr_schedule_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    from nsa.train.config import TrainConfig
    from nsa.train.optim import lr_factor

    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(111)]
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
