"""End-to-end training on the embedded corpus, run artifacts, checkpoints and CLI errors."""

import csv
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nsa.cli import main
from nsa.config import load_config
from nsa.errors import UserError
from nsa.model import Transformer
from nsa.model.config import ModelConfig
from nsa.train import checkpoint
from nsa.telemetry.run_files import read_jsonl as read_events
from nsa.train.loop import train
from nsa.typed_config import from_dict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

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
    assert list(rows[0]) == ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s",
                            "mem_gb", "data_wait", "seq_len"]
    assert [int(r["step"]) for r in rows] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    assert {r["seq_len"] for r in rows} == {"64"}  # one length: train.seq_len
    assert rows[3]["val_loss"] == "" and float(rows[4]["val_loss"]) > 0
    saved = yaml.safe_load(open(run / "config.yaml"))
    assert saved["model"]["vocab_size"] == 320 and saved["train"]["steps"] == 80
    assert result.sample.startswith("And God said") and len(result.sample) > len("And God said")

    # The final checkpoint rebuilds the same model.
    assert result.checkpoint.name == "step_00000080" and checkpoint.read_meta(result.checkpoint)["step"] == 80
    model = Transformer(from_dict(ModelConfig, checkpoint.read_meta(result.checkpoint)["config"]["model"]))
    checkpoint.load_model_weights(result.checkpoint, model)
    tokens = torch.randint(0, 256, (1, 64))
    assert torch.isfinite(model(tokens[:, :-1], tokens[:, 1:]))


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_as_the_latest(tmp_path, monkeypatch):
    cfg = load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=4",
                                    "checkpoint.every=2", "train.sample_tokens=0"])
    train(cfg)
    ckpts = tmp_path / "r" / "checkpoints"
    assert [p.name for p in checkpoint.completed(ckpts)] == ["step_00000002", "step_00000004"]

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dcp, "save", broken_save)
    latest = ckpts / "step_00000004"
    with pytest.raises(UserError, match=rf"could not write {ckpts / 'step_00000002'}: OSError: disk full; the latest "
                                        rf"complete checkpoint, {latest}, is intact"):
        train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=6",
                                        "checkpoint.every=2", "train.sample_tokens=0", "checkpoint.resume=none"]))
    assert checkpoint.latest(tmp_path / "r").name == "step_00000004"
    assert checkpoint.read_meta(checkpoint.latest(tmp_path / "r"))["step"] == 4


def test_keep_limits_the_checkpoints_and_export_writes_safetensors(tmp_path):
    from safetensors.torch import load_file

    train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=k", "train.steps=6",
                                    "checkpoint.every=1", "checkpoint.keep=2", "train.sample_tokens=0"]))
    assert [p.name for p in checkpoint.completed(tmp_path / "k" / "checkpoints")] == ["step_00000005", "step_00000006"]
    out = checkpoint.export_safetensors(tmp_path / "k", tmp_path / "w.safetensors")
    weights = load_file(str(out))
    assert "lm_head.weight" not in weights and weights["tok_emb.weight"].shape == (320, 64)
    model = Transformer(from_dict(ModelConfig, checkpoint.read_meta(checkpoint.latest(tmp_path / "k"))["config"]["model"]))
    missing = model.load_state_dict(weights, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to tok_emb.weight


def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    common = FAST + [f"train.out_dir={tmp_path}", "train.steps=12", "train.log_every=1", "train.sample_tokens=0"]
    full = train(load_config(None, common + ["train.run_name=full"]))
    part = train(load_config(None, common + ["train.run_name=cut", "train.stop_after=5"]))
    assert sorted(part.losses) == [1, 2, 3, 4, 5]
    rest = train(load_config(None, common + ["train.run_name=cut"]))
    assert sorted(rest.losses) == list(range(6, 13))
    assert {**part.losses, **rest.losses} == full.losses  # bit-identical
    rows = list(csv.DictReader(open(tmp_path / "cut" / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 13))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"))])
def test_deterministic_runs_repeat_and_resume_bit_for_bit(tmp_path, device):
    # On a GPU: compiled blocks, the Triton/Gluon kernels, 64 selection blocks a sequence (block-centric selected
    # backward, several work items a block, split dK/dV rows). Without train.deterministic two such runs differ
    # from the first steps on (float32 atomics).
    steps = 6 if device == "cuda" else 4
    common = FAST + [f"train.out_dir={tmp_path}", f"train.steps={steps}", "train.log_every=1", "train.sample_tokens=0",
                     "train.deterministic=true", f"train.device={device}"]
    if device == "cuda":
        common += ["train.seq_len=4096", "train.batch_size=2", "model.head_dim=64", "model.dim=256",
                   "parallel.compile=true", "parallel.allow_single_process=true"]
    full = train(load_config(None, common + ["train.run_name=full"]))
    assert torch.are_deterministic_algorithms_enabled()
    again = train(load_config(None, common + ["train.run_name=again"]))
    assert again.losses == full.losses  # bit-identical
    part = train(load_config(None, common + ["train.run_name=cut", "train.stop_after=2"]))
    rest = train(load_config(None, common + ["train.run_name=cut"]))
    assert {**part.losses, **rest.losses} == full.losses and len(full.losses) == steps
    train(load_config(None, common + ["train.run_name=plain", "train.steps=1", "train.deterministic=false"]))
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "train.stpes=3"], "nsa: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
        (["train", "missing.yaml"], "nsa: error: config file 'missing.yaml' not found"),
        (["train", "nosuchpreset"], "nsa: error: config 'nosuchpreset' not found"),
        (["train", "data.source=text", "data.path=/no/such/dir"], "nsa: error: data.path '/no/such/dir' does not exist"),
        (["train", "parallel.cudagraphs=true", "parallel.compile=false"],
         "nsa: error: parallel.cudagraphs=true replays compiled blocks: add parallel.compile=true"),
        (["train", "train.device=cuda:0"] if not torch.cuda.is_available() else ["train", "train.device=tpu"], "nsa: error: train.device="),
        # The CPU has no cuDNN attention: refused before anything compiles, naming the key.
        (["train", "model.attention=dense", "model.dense_backend=cudnn", "train.device=cpu", "parallel.compile=true"],
         "nsa: error: model.dense_backend=cudnn has no SDPA kernel for this call (cpu"),
        (["bench", "train", "--attention", "nsa,dense:fast"], "nsa: error: unknown --attention entry 'dense:fast'"),
    ],
)
def test_cli_user_errors_are_one_line_with_exit_code_2(args, message, capsys, tmp_path):
    # One process on purpose: on a machine with several GPUs the launch check would otherwise speak first for the
    # mistakes found after it (a missing data.path, an unknown device), and this test is about the messages.
    assert main(args + [f"train.out_dir={tmp_path}", "parallel.allow_single_process=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_python_dash_m_nsa_prints_the_resolved_config():
    out = subprocess.run(
        [sys.executable, "-m", "nsa", "config", str(CONFIGS / "m7c.yaml"), "train.steps=3"],
        capture_output=True, text=True, check=True,
    ).stdout
    cfg = yaml.safe_load(out)
    assert cfg["model"]["dim"] == 768 and cfg["train"]["steps"] == 3


def test_gradient_accumulation_matches_one_large_batch(tmp_path):
    common = FAST + [f"train.out_dir={tmp_path}", "train.steps=3", "train.log_every=1", "train.sample_tokens=0"]
    big = train(load_config(None, common + ["train.run_name=a", "train.batch_size=8", "train.grad_accum=1"]))
    small = train(load_config(None, common + ["train.run_name=b", "train.batch_size=4", "train.grad_accum=2"]))
    assert big.losses.keys() == small.losses.keys()
    for step in big.losses:
        assert small.losses[step] == pytest.approx(big.losses[step], abs=1e-5)


MIXED_RETRIEVAL = [
    "model.attention=dense", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
    "model.head_dim=16", "model.mlp_hidden=64", "data.source=retrieval", "data.retrieval.task=passkey",
    "data.retrieval.mix_lengths=[256,512]", "train.seq_len=128", "train.batch_size=4", "train.steps=12",
    "train.warmup_steps=1", "train.eval_every=0", "train.log_every=1", "train.sample_tokens=0", "train.progress=false",
    "telemetry.tensorboard=false",
]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_metrics_record_each_steps_sequence_length_under_mixed_lengths(tmp_path, grad_accum):
    """seq_len is the length of the batches the step trained on; a step whose micro-batches were drawn at
    different lengths has none."""
    from nsa.data.loader import RetrievalBatches
    from nsa.data.retrieval import RetrievalTasks
    from nsa.data.tokenizers import ByteTokenizer

    cfg = load_config(None, MIXED_RETRIEVAL + [f"train.grad_accum={grad_accum}", f"train.out_dir={tmp_path}",
                                               "train.run_name=r"])
    train(cfg)
    logged = [r["seq_len"] for r in csv.DictReader(open(tmp_path / "r" / "metrics.csv"))]
    # The same stream the trainer drew from: seed train.seed, rank 0, one batch per micro-batch.
    stream = RetrievalBatches(RetrievalTasks(ByteTokenizer()), "passkey", 128, 4, cfg.train.seed,
                              mix_lengths=[256, 512])
    drawn = [stream.next_batch()[0].shape[1] for _ in range(12 * grad_accum)]
    per_step = [set(drawn[i:i + grad_accum]) for i in range(0, len(drawn), grad_accum)]
    assert logged == [str(min(s)) if len(s) == 1 else "" for s in per_step]
    # This seed's draw mixes lengths between steps (and, with accumulation, within one), so a column of
    # train.seq_len alone, or of one micro-batch's length, would fail the check above.
    assert len({n for n in logged if n}) > 1 and ("" in logged) == (grad_accum > 1)


def test_lr_schedule_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    from nsa.train.config import TrainConfig
    from nsa.train.optim import lr_factor

    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(111)]
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_training_with_torch_compile_and_activation_checkpointing(tmp_path, capsys):
    result = train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.steps=3", "train.log_every=1",
                                             "train.sample_tokens=0", "parallel.compile=true",
                                             "parallel.activation_checkpointing=true", "model.attention=dense"]))
    assert "the first steps compile the blocks:" in capsys.readouterr().out  # the wait before step 1 is announced
    plain = train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.steps=3", "train.log_every=1",
                                            "train.sample_tokens=0", "model.attention=dense"]))
    for step in plain.losses:
        assert result.losses[step] == pytest.approx(plain.losses[step], abs=1e-4)


def test_cuda_graphs_on_the_cpu_are_a_one_line_error(capsys, tmp_path):
    assert main(["train", "train.device=cpu", "parallel.allow_single_process=true", "parallel.compile=true",
                 "parallel.cudagraphs=true", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsa: error: parallel.cudagraphs=true needs a CUDA device") and err.count("\n") == 1, err


@pytest.mark.parametrize("compile_,mode,device,message", [
    (False, "single", "cuda", "add parallel.compile=true"),
    (True, "fsdp", "cuda", "drop it under parallel.mode=fsdp"),
    (True, "ddp", "cpu", "needs a CUDA device, not cpu"),
])
def test_cuda_graphs_refuse_what_they_cannot_replay(compile_, mode, device, message):
    from nsa.train.config import ParallelConfig

    cfg = ParallelConfig(compile=compile_, cudagraphs=True)
    with pytest.raises(UserError, match=message):
        cfg.check_cudagraphs(mode, device)
    ParallelConfig(compile=compile_, cudagraphs=False).check_cudagraphs(mode, device)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.cudagraphs=true", "parallel.compile=false"], "add parallel.compile=true"),
    (["parallel.cudagraphs=true", "parallel.compile=true", "parallel.mode=fsdp"], "drop it under parallel.mode=fsdp"),
])
def test_cuda_graph_settings_fail_at_load_before_any_launch_check(overrides, message):
    # On a machine with several GPUs the launch check (one process per GPU) would otherwise speak first.
    from nsa.config import load_config
    from nsa.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    load_config(None, ["parallel.cudagraphs=true", "parallel.compile=true", "parallel.mode=ddp"])


@pytest.mark.parametrize("compile_,cudagraphs,mode,device,want", [
    # 'auto' compiles on a GPU only, and replays graphs wherever they can run: not on a CPU, not under FSDP2.
    ("auto", "auto", "single", "cuda", (True, True)),
    ("auto", "auto", "ddp", "cuda", (True, True)),
    ("auto", "auto", "fsdp", "cuda", (True, False)),
    ("auto", "auto", "single", "cpu", (False, False)),
    (False, "auto", "single", "cuda", (False, False)),
    ("auto", False, "ddp", "cuda", (True, False)),
    (True, "auto", "single", "cpu", (True, False)),
    # Explicit settings are kept as asked (ParallelConfig.check_cudagraphs then refuses what cannot run).
    ("auto", True, "fsdp", "cuda", (True, True)),
    ("auto", True, "single", "cpu", (False, True)),
])
def test_auto_compile_and_cuda_graphs_resolve_per_device_and_mode(compile_, cudagraphs, mode, device, want):
    from nsa.train.config import ParallelConfig

    cfg = ParallelConfig(compile=compile_, cudagraphs=cudagraphs).resolved(mode, device)
    assert (cfg.compile, cfg.cudagraphs) == want


def test_the_defaults_compile_and_replay_on_a_gpu_and_run_eager_on_a_cpu(monkeypatch, tmp_path, capsys):
    """What a bare `nsa train` does: the CPU run stays eager (its banner says so) and its config.yaml keeps 'auto'
    (so a GPU run's config still trains on a CPU); the same config on a GPU resolves to compiled graphs."""
    from nsa.train.loop import step_kind

    cfg = load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=auto", "train.steps=1",
                                    "train.sample_tokens=0", "train.device=cpu", "parallel.allow_single_process=true"])
    assert (cfg.parallel.compile, cfg.parallel.cudagraphs) == ("auto", "auto")
    assert step_kind(cfg.parallel.resolved("single", "cuda")) == "graphs"
    assert step_kind(cfg.parallel.resolved("fsdp", "cuda")) == "compiled"
    # The banner asks for the FSDP2 note with the run's mode and device (the note itself: the test below).
    monkeypatch.setattr("nsa.train.loop.fsdp_pace_note", lambda mode, device: f"pace note for {mode} on {device}")
    train(cfg)
    out = capsys.readouterr().out
    assert ", cpu, eager" in out and "pace note for single on cpu" in out
    saved = yaml.safe_load(open(tmp_path / "auto" / "config.yaml"))
    assert saved["parallel"]["compile"] == saved["parallel"]["cudagraphs"] == "auto"


@pytest.mark.parametrize("mode, device, noted", [("fsdp", "cuda", True), ("ddp", "cuda", False),
                                                 ("single", "cuda", False), ("fsdp", "cpu", False)])
def test_the_banner_notes_that_fsdp2_on_a_gpu_replays_no_graphs(mode, device, noted):
    """FSDP2 at few sequences per GPU is paced by the host (no graphs): the banner says so and names DDP."""
    from nsa.train.loop import fsdp_pace_note

    note = fsdp_pace_note(mode, device)
    assert (note is not None) == noted
    if noted:
        assert "parallel.mode=ddp" in note and "\n" not in note


def test_uncompiled_runs_compiled_modules_eagerly_and_then_restores_them():
    from nsa.train.parallel import uncompiled

    def refuse(gm, example_inputs):
        raise AssertionError("the compiled __call__ ran")

    class Double(torch.nn.Module):  # defined here: dynamo inlines torch.nn's own modules without a graph
        def forward(self, x):
            return 2 * x

    model = torch.nn.Sequential(Double(), Double())
    for layer in model:
        layer.compile(backend=refuse)
    x = torch.randn(2, 4)
    with uncompiled(model):
        assert torch.equal(model(x), 4 * x)
    with pytest.raises(Exception, match="the compiled __call__ ran"):
        model(x)


@pytest.mark.parametrize("cudagraphs,want_gb", [(False, 3.0), (True, 5.0)])
def test_logged_memory_under_cuda_graphs_is_the_peak_reserved(monkeypatch, cudagraphs, want_gb):
    # Replays allocate from their graphs' private pools, which the allocated count misses (0.22 GB logged on a
    # GPU run that held over 7 GB).
    from nsa.train.loop import peak_memory_gb

    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    assert peak_memory_gb(torch.device("cuda", 0), cudagraphs) == want_gb
    assert resets == [torch.device("cuda", 0)]  # each metrics row covers the steps since the previous one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@pytest.mark.parametrize("attention,checkpointing", [("nsa", False), ("dense", False), ("nsa", True)])
def test_cuda_graph_steps_give_the_compiled_steps_losses(tmp_path, attention, checkpointing):
    """parallel.cudagraphs replays the compiled blocks' forward and backward from graphs; with gradient
    accumulation (two backward passes into the same .grad per step) and evaluation in between, the losses must
    follow the plain compiled run's."""
    common = FAST + [f"train.out_dir={tmp_path}", "train.steps=6", "train.log_every=1", "train.sample_tokens=20",
                     "train.batch_size=4", "train.grad_accum=2", "train.eval_every=3", "train.device=cuda",
                     "parallel.compile=true", "parallel.allow_single_process=true", f"model.attention={attention}",
                     f"parallel.activation_checkpointing={str(checkpointing).lower()}"]
    graphed = train(load_config(None, common + ["train.run_name=g", "parallel.cudagraphs=true"]))
    plain = train(load_config(None, common + ["train.run_name=p", "parallel.cudagraphs=false"]))
    assert graphed.losses.keys() == plain.losses.keys() == set(range(1, 7))
    for step in plain.losses:
        assert graphed.losses[step] == pytest.approx(plain.losses[step], rel=2e-3), step
    assert graphed.val_loss == pytest.approx(plain.val_loss, rel=2e-3)
    # A replay that wrote over the first micro-batch's gradients would show here first (twice or half the norm).
    norms = [[float(r["grad_norm"]) for r in csv.DictReader(open(tmp_path / run / "metrics.csv"))] for run in "gp"]
    assert norms[0] == pytest.approx(norms[1], rel=1e-2)
    assert graphed.sample.startswith("And God said")


def test_a_non_finite_loss_halts_with_a_checkpoint_and_a_message(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_forward = Transformer.forward

    def poisoned(self, tokens, targets=None, cu_seqlens=None):
        out = real_forward(self, tokens, targets, cu_seqlens)
        calls["n"] += 1
        return out * float("nan") if targets is not None and calls["n"] == 4 else out

    monkeypatch.setattr(Transformer, "forward", poisoned)
    cfg = load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=nan", "train.steps=20",
                                    "train.log_every=5", "checkpoint.every=2", "train.sample_tokens=0"])
    # Step 4's update already used the NaN gradients, so the last good checkpoint is step 2's.
    with pytest.raises(UserError, match=r"non-finite at step 4; stopped at step 4 .* the last good checkpoint is "
                                        r".*step_00000002"):
        train(cfg)
    assert (tmp_path / "nan" / "checkpoints" / "halt_00000004" / "COMPLETE.json").is_file()
    assert checkpoint.latest(tmp_path / "nan").name == "step_00000002"
    events = [e["event"] for e in read_events(tmp_path / "nan" / "heartbeat_rank0.jsonl")]
    assert events[-1] == "halt" and "done" not in events


def test_training_flops_count_attention_keys_per_query():
    from nsa.bench.training import attention_keys_per_query
    from nsa.model import m7c

    cfg = load_config(None, [])
    dense = dataclasses.replace(cfg, model=dataclasses.replace(m7c(), attention="dense"))
    sparse = dataclasses.replace(cfg, model=m7c())
    assert attention_keys_per_query(dense, 32768) == 16384
    # 32k: ~1024 compressed (on average) + 16 x 64 selected + 512 window, the ratio of docs/performance.md.
    assert attention_keys_per_query(sparse, 32768) == pytest.approx(1023 + 1024 + 512, abs=1)
