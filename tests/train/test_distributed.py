"""Multi-process training on CPU: 2-rank gloo torchrun runs of DDP and FSDP2 against one process,
exact resume with 2 ranks, and the launch guardrails."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nsa.cli import main
from nsa.errors import UserError
from nsa.telemetry.report import render_report
from nsa.telemetry.run_files import read_jsonl as read_events

TINY = [
    "model.n_layers=2", "model.dim=64", "model.head_dim=16", "model.mlp_hidden=128", "train.seq_len=64",
    "train.progress=false", "train.log_every=1", "train.eval_every=4", "train.sample_tokens=0", "train.steps=8",
    "train.grad_clip=0.05",  # always active: checks the global norm under DDP and FSDP2
]


def losses(run_dir: Path) -> dict[int, tuple[float, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): (float(r["loss"]), r["val_loss"]) for r in csv.DictReader(f)}


def _launch(target: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *target]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 -m nsa train ARGS`."""
    return _launch(["-m", "nsa", "train", *args], timeout=600)


def torchrun_script(tmp_path: Path, prelude: str, args_expr: str, timeout: int = 300):
    """Two ranks that run `prelude` (Python that may patch the model per rank), then `nsa train` with TINY
    and the overrides the Python expression `args_expr` gives (it may depend on the rank)."""
    script = tmp_path / "launch.py"
    script.write_text(
        "import os, sys\nfrom nsa.cli import main\nfrom nsa.model import Transformer\n" + prelude
        + f"sys.exit(main(['train', *{TINY!r}, 'train.out_dir={tmp_path}', *{args_expr}]))\n"
    )
    return _launch([str(script)], timeout)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", *TINY, f"train.out_dir={out}", "train.run_name=single", "train.batch_size=4"]) == 0
    return losses(out / "single")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    out = tmp_path_factory.mktemp("two_rank")
    runs = {}
    for mode in ("ddp", "fsdp"):
        proc = torchrun([*TINY, f"train.out_dir={out}", f"train.run_name={mode}", "train.batch_size=2",
                         f"parallel.mode={mode}", "telemetry.health_every=1"])
        runs[mode] = (out / mode, proc)
    return runs


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_on_the_same_global_batch(mode, single_run, two_rank_runs):
    run, proc = two_rank_runs[mode]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] local rank 0, world size 2" in proc.stderr and "[rank 1] local rank 1, world size 2" in proc.stderr
    got = losses(run)
    assert got.keys() == single_run.keys()
    for step, (loss, val) in single_run.items():
        assert got[step][0] == pytest.approx(loss, abs=2e-4), step
        if val:
            assert float(got[step][1]) == pytest.approx(float(val), abs=2e-4)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_runs_leave_every_ranks_artifacts_and_a_report(mode, two_rank_runs):
    run, proc = two_rank_runs[mode]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        events = read_events(run / f"heartbeat_rank{rank}.jsonl")
        names = [e["event"] for e in events]
        assert names[0] == "boot" and names[-1] == "done" and names.count("step") == 8, (rank, names)
        assert {e["rank"] for e in events} == {rank} and events[0]["world_size"] == 2
    assert json.loads((run / "env.json").read_text())["world_size"] == 2
    stats = read_events(run / "nsa_stats.jsonl")
    assert [s["step"] for s in stats] == list(range(1, 9))
    # Both ranks' probe sequences are counted: 2 ranks x 64 tokens, every token picks at least one block.
    assert sum(stats[0]["distance_counts"][0]) >= 2 * 64
    report = render_report(run)
    assert (report.parent / "gates.png").is_file() and "8" in report.read_text()


def test_health_statistics_agree_between_ddp_and_fsdp(two_rank_runs):
    records = {}
    for mode, (run, proc) in two_rank_runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[mode] = read_events(run / "nsa_stats.jsonl")[0]
    for ddp, fsdp in zip(records["ddp"]["layers"], records["fsdp"]["layers"]):
        assert fsdp["gate_mean"] == pytest.approx(ddp["gate_mean"], abs=1e-5)
        assert fsdp["gate_std"] == pytest.approx(ddp["gate_std"], abs=1e-5)
        assert fsdp["sel_distance_mean"] == pytest.approx(ddp["sel_distance_mean"], rel=1e-3)
    assert records["fsdp"]["distance_counts"] == records["ddp"]["distance_counts"]


def test_two_rank_run_stopped_and_resumed_continues_the_loss_curve_exactly(tmp_path):
    common = [*TINY, f"train.out_dir={tmp_path}", "train.batch_size=2", "parallel.mode=ddp",
              "parallel.activation_checkpointing=true"]
    full = torchrun([*common, "train.run_name=full"])
    assert full.returncode == 0, full.stderr[-3000:]
    first = torchrun([*common, "train.run_name=cut", "train.stop_after=3"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(losses(tmp_path / "cut")) == [1, 2, 3]
    second = torchrun([*common, "train.run_name=cut"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    want, got = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert got.keys() == want.keys()
    for step in want:
        assert got[step][0] == want[step][0], (step, got[step], want[step])  # bit-identical


def test_ranks_with_different_configs_fail_fast(tmp_path):
    # torchrun gives every rank the same arguments; a learning rate that differs per rank mimics a broken launch.
    proc = torchrun_script(tmp_path, "", "['train.lr=' + str(1e-3 * (1 + int(os.environ['RANK'])))]")
    assert proc.returncode != 0
    assert "ranks disagree on the config: rank 1 differs from rank 0 in train.lr" in proc.stderr


def test_a_halt_file_stops_both_ranks_at_the_same_step_with_a_checkpoint(tmp_path):
    from nsa.train.stop import LAG

    run = tmp_path / "halt"
    run.mkdir()
    (run / "HALT").touch()  # present from the start: both ranks see it at step 1
    proc = torchrun([*TINY, f"train.out_dir={tmp_path}", "train.run_name=halt", "train.batch_size=2",
                     "parallel.mode=fsdp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "HALT").exists() and "stopped at step 3 because" in proc.stdout
    assert (run / "checkpoints" / f"step_{1 + LAG:08d}" / "COMPLETE.json").is_file()
    for rank in (0, 1):
        events = read_events(run / f"heartbeat_rank{rank}.jsonl")
        halts = [e for e in events if e["event"] == "halt"]
        assert len(halts) == 1 and halts[0]["step"] == 1 + LAG and halts[0]["reason"] == "HALT file", (rank, events)


def test_a_non_finite_loss_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    # Rank 1 alone sees a NaN loss at its 4th forward; the agreement must stop rank 0 too, at the same step.
    prelude = (
        "real, calls = Transformer.forward, [0]\n"
        "def poisoned(self, tokens, targets=None, cu_seqlens=None):\n"
        "    out = real(self, tokens, targets, cu_seqlens)\n"
        "    if targets is not None and self.training:\n"
        "        calls[0] += 1\n"
        "        if os.environ['RANK'] == '1' and calls[0] == 4:\n"
        "            out = out * float('nan')\n"
        "    return out\n"
        "Transformer.forward = poisoned\n"
    )
    proc = torchrun_script(tmp_path, prelude, "['train.run_name=nan', 'train.batch_size=2', 'parallel.mode=ddp', "
                                              "'train.log_every=100', 'train.eval_every=0']")
    assert proc.returncode != 0
    assert proc.stderr.count("non-finite at step 4; stopped at step 6") == 2, proc.stderr[-3000:]
    assert (tmp_path / "nan" / "checkpoints" / "halt_00000006" / "COMPLETE.json").is_file()
    for rank in (0, 1):
        halts = [e for e in read_events(tmp_path / "nan" / f"heartbeat_rank{rank}.jsonl") if e["event"] == "halt"]
        assert [(h["step"], h["bad_step"]) for h in halts] == [(6, 4)], rank


def test_fsdp_can_reduce_gradients_in_bf16_and_still_matches_one_process(tmp_path, single_run):
    # Every fully_shard call records the reduce type it was given: the option must reach each block and the root.
    record = tmp_path / "reduce_dtype_rank"
    prelude = (
        "import torch.distributed.fsdp as fsdp\n"
        "real_shard = fsdp.fully_shard\n"
        "def recording(module, **kw):\n"
        f"    with open({str(record)!r} + os.environ['RANK'], 'a') as f:\n"
        "        f.write(str(kw['mp_policy'].reduce_dtype) + '\\n')\n"
        "    return real_shard(module, **kw)\n"
        "fsdp.fully_shard = recording\n"
    )
    proc = torchrun_script(tmp_path, prelude, "['train.run_name=bf16', 'train.batch_size=2', 'parallel.mode=fsdp', "
                                              "'parallel.fsdp_reduce_dtype=bfloat16']")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"reduce_dtype_rank{rank}").read_text().split() == ["torch.bfloat16"] * 3  # 2 blocks, root
    got = losses(tmp_path / "bf16")
    for step, (loss, _) in single_run.items():
        assert got[step][0] == pytest.approx(loss, abs=1e-3), step


def test_a_profiled_benchmark_step_runs_on_every_rank(tmp_path):
    # The profiled step holds the gradient all-reduce: taken by rank 0 alone, it waited for the timeout.
    script = tmp_path / "profiled.py"
    script.write_text(
        "import datetime, os, sys\nfrom pathlib import Path\nimport torch, torch.distributed as dist\n"
        "from nsa.bench.training import profiled_step\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=20))\n"
        "rank, t = dist.get_rank(), torch.ones(4)\n"
        f"profiled_step(lambda: dist.all_reduce(t), Path({str(tmp_path)!r}) / 'profile.txt', rank == 0)\n"
        "assert t.tolist() == [2.0] * 4\n"
        "dist.barrier()\ndist.destroy_process_group()\n"
    )
    proc = _launch([str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "allreduce" in (tmp_path / "profile.txt").read_text().lower()


def test_an_error_on_one_rank_ends_the_job_instead_of_hanging_it(tmp_path):
    # Rank 1 fails mid-run while rank 0 waits in a gradient all-reduce: the job must end within
    # seconds, not after the collective timeout (300 s here), with rank 1's error on screen.
    prelude = (
        "real, calls = Transformer.forward, [0]\n"
        "def failing(self, tokens, targets=None, cu_seqlens=None):\n"
        "    calls[0] += 1\n"
        "    if os.environ['RANK'] == '1' and calls[0] == 3:\n"
        "        raise RuntimeError('rank 1 broke on purpose')\n"
        "    return real(self, tokens, targets, cu_seqlens)\n"
        "Transformer.forward = failing\n"
    )
    start = time.monotonic()
    proc = torchrun_script(tmp_path, prelude, "['train.run_name=fail', 'train.batch_size=2', 'parallel.mode=ddp', "
                                              "'parallel.timeout_s=300']", timeout=240)
    assert proc.returncode != 0 and "rank 1 broke on purpose" in proc.stderr
    assert time.monotonic() - start < 120, "the job waited for the collective timeout"


def test_ddp_without_several_processes_names_the_launch_command(capsys, tmp_path):
    assert main(["train", *TINY, f"train.out_dir={tmp_path}", "parallel.mode=fsdp"]) == 2
    err = capsys.readouterr().err
    assert "parallel.mode=fsdp needs several processes: launch with `torchrun --nproc_per_node=N" in err


def test_several_visible_gpus_with_one_process_is_an_error(monkeypatch):
    from nsa.train import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(UserError, match=r"4 GPUs are visible but this is a single process; launch one process per "
                                        r"GPU with `torchrun --nproc_per_node=4 -m nsa train"):
        distributed.init_distributed("cuda", 60, allow_single_process=False)
    info = distributed.init_distributed("cuda", 60, allow_single_process=True)
    assert info.world_size == 1 and info.device == torch.device("cuda", 0)
