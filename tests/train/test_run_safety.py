"""Never lose a run: signals, one writer per run folder, resume with a changed config, damaged checkpoints.

Each case runs the way a user meets it: `nsa train` in a subprocess that gets real signals, two real launches
at once, real truncated files; each asserts the message, the exit code and that what was written survives.
"""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from nsa.cli import main
from nsa.telemetry.run_files import read_jsonl as read_events
from nsa.train import checkpoint
from nsa.train.optim import lr_factor
from nsa.train.config import TrainConfig
from nsa.train.run_folder import LOCK, claim_run_folder

TINY = [
    "model.n_layers=2", "model.dim=64", "model.head_dim=16", "model.mlp_hidden=128", "model.nsa.block_len=8",
    "model.nsa.block_stride=4", "model.nsa.sel_block=8", "model.nsa.window=16", "train.seq_len=48",
    "train.batch_size=4", "train.warmup_steps=4", "train.eval_every=0", "train.sample_tokens=0",
    "train.progress=false", "train.log_every=1", "telemetry.tensorboard=false",
]
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # the same float sums in every process of a comparison


def launch(args: list[str], prelude: str = "", **popen) -> subprocess.Popen:
    """`nsa train TINY ARGS` in a new process, after the Python `prelude` (which may patch the trainer)."""
    code = f"import sys\n{prelude}\nfrom nsa.cli import main\nsys.exit(main(['train', *{TINY + args!r}]))\n"
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-c", code], env=ENV, text=True, **popen)


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = launch(args)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def wait_for(condition, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def logged_step(run_dir: Path) -> int:
    """The last step in the rank-0 heartbeat (0 before the first)."""
    path = run_dir / "heartbeat_rank0.jsonl"
    if not path.exists():
        return 0
    steps = [e["step"] for e in read_events(path) if e["event"] == "step"]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    proc = run([f"train.out_dir={out}", "train.run_name=full", "train.steps=24"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "full"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> dict[int, float]:
    return losses(uninterrupted_run)


@pytest.mark.parametrize("signum,close_stdout", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_and_the_resumed_run_matches(
        tmp_path, uninterrupted, signum, close_stdout):
    run_dir = tmp_path / "cut"
    proc = launch([f"train.out_dir={tmp_path}", "train.run_name=cut", "train.steps=24"])
    wait_for(lambda: logged_step(run_dir) >= 3, what="step 3")
    if close_stdout:  # `nsa train | tee log` and Ctrl-C: tee is gone, the run must still save
        proc.stdout.close()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("nsa:")]
    assert len(lines) == 1 and f" on {name}; checkpoint: " in lines[0], err[-2000:]
    assert "Traceback" not in err

    saved = checkpoint.latest(run_dir)
    stopped = checkpoint.read_meta(saved)["step"]
    assert 3 <= stopped < 24 and lines[0].startswith(f"nsa: stopped at step {stopped} on {name}")
    # The data position is that of the step boundary: 4 windows a step, none drawn for a step not taken.
    state = torch.load(saved / "rank0.pt", weights_only=False)
    assert state["step"] == stopped and state["data"]["cursor"] == 4 * stopped
    halts = [e for e in read_events(run_dir / "heartbeat_rank0.jsonl") if e["event"] == "halt"]
    assert [(h["step"], h["reason"]) for h in halts] == [(stopped, name)]
    assert not (run_dir / LOCK).exists()

    rest = run([f"train.out_dir={tmp_path}", "train.run_name=cut", "train.steps=24"])
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert losses(run_dir) == uninterrupted  # bit for bit, every step


def test_a_second_signal_exits_at_once_and_the_next_launch_takes_over_the_stale_lock(tmp_path):
    # The save that the first signal starts takes a minute: the second signal must not wait for it.
    prelude = ("import time\nfrom nsa.train import checkpoint\nreal = checkpoint.save\n"
               "def slow(*a, **k):\n    time.sleep(60)\n    return real(*a, **k)\ncheckpoint.save = slow\n")
    run_dir = tmp_path / "r"
    proc = launch([f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=400"], prelude)
    wait_for(lambda: logged_step(run_dir) >= 2, what="step 2")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: any(e["event"] == "signal" for e in read_events(run_dir / "heartbeat_rank0.jsonl")),
             what="the signal event")
    time.sleep(1.2)  # later than a launcher's forwarded copy of the first signal
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - started < 10
    assert "SIGINT again: exiting now" in err and "Traceback" not in err
    assert checkpoint.latest(run_dir) is None and (run_dir / LOCK).exists()  # gone without cleaning up

    again = run([f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=2"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"note: took over {run_dir / LOCK}, left by pid {proc.pid}" in again.stdout


def test_two_launches_with_one_run_name_one_runs_the_other_stops_naming_it(tmp_path):
    args = [f"train.out_dir={tmp_path}", "train.run_name=same", "train.steps=12"]
    procs = [launch(args), launch(args)]
    results = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err[-1500:]) for p, _, err in results]
    winner = next(p for p, _, _ in results if p.returncode == 0)
    _, _, err = next(r for r in results if r[0].returncode == 2)
    assert (f"nsa: error: run folder {tmp_path / 'same'} is in use by pid {winner.pid} on {socket.gethostname()}"
            in err), err
    assert "choose another train.run_name" in err and len(err.strip().splitlines()) == 1
    # The winner's files are whole: every step once, no fragment of another writer.
    rows = list(csv.DictReader(open(tmp_path / "same" / "metrics.csv", newline="")))
    assert [int(r["step"]) for r in rows] == list(range(1, 13)) and all(r["loss"] for r in rows)


def test_a_lock_left_on_another_host_is_refused_with_the_fix(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then", "command": "nsa"}))
    with pytest.raises(Exception, match=rf"in use by pid 1 on elsewhere .*; if that process is over, delete "
                                        rf"{run_dir / LOCK}"):
        claim_run_folder(tmp_path, "r", "unused")
    (run_dir / LOCK).write_text(json.dumps({"pid": 2 ** 22 + 12345, "host": socket.gethostname()}))
    folder = claim_run_folder(tmp_path, "r", "unused")  # the same host, a pid that is not running: stale
    assert "no longer running" in folder.note and not folder.created
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
    folder.release()
    assert not (run_dir / LOCK).exists()


@pytest.fixture()
def trained(tmp_path) -> Path:
    """A run of 6 steps with checkpoints at steps 3 and 6."""
    assert main(["train", *TINY, f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=6",
                 "checkpoint.every=3"]) == 0
    return tmp_path / "r"


def _resume(run_dir: Path, *overrides: str) -> int:
    return main(["train", *TINY, f"train.out_dir={run_dir.parent}", "train.run_name=r", *overrides])


@pytest.mark.parametrize("override,listed", [
    ("model.nsa.phi=mean", "model.nsa.phi 'mlp' -> 'mean'"),
    ("model.dim=96", "model.dim 64 -> 96"),
    ("train.seed=7", "train.seed 1337 -> 7"),
    ("data.tokenizer=gpt2", "data.tokenizer 'byte' -> 'gpt2'"),
    ("data.document_masking=false", "data.document_masking 'auto' -> False"),
])
def test_resuming_with_a_change_that_shapes_the_model_or_data_is_refused(trained, capsys, override, listed):
    before = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()}
    assert _resume(trained, "train.steps=9", override) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nsa: error: cannot resume from {trained / 'checkpoints' / 'step_00000006'}: ")
    assert listed in err and "train.steps" not in err and len(err.strip().splitlines()) == 1
    after = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()}
    assert after == before  # config.yaml, metrics and checkpoints untouched


def test_a_length_curriculum_resumes_one_run_at_a_longer_context(trained, capsys):
    assert _resume(trained, "train.steps=8", "train.seq_len=96", "train.batch_size=3") == 0
    assert "train.seq_len 48 -> 96, train.batch_size 4 -> 3" in capsys.readouterr().out
    rows = list(csv.DictReader(open(trained / "metrics.csv", newline="")))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert [int(r["tokens"]) for r in rows[5:]] == [6 * 4 * 48, 6 * 4 * 48 + 3 * 96, 6 * 4 * 48 + 2 * 3 * 96]


def test_resuming_with_a_new_learning_rate_applies_it_and_records_it(trained, capsys):
    assert _resume(trained, "train.steps=9", "train.lr=0.01", "train.warmup_steps=2") == 0
    rows = {int(r["step"]): r for r in csv.DictReader(open(trained / "metrics.csv", newline=""))}
    cfg = TrainConfig(steps=9, lr=0.01, warmup_steps=2)
    for step in (7, 8, 9):  # the lr logged after step s is the one of the next step, s (0-based)
        assert float(rows[step]["lr"]) == pytest.approx(0.01 * lr_factor(step, cfg), rel=1e-5)
    assert yaml.safe_load(open(trained / "config.yaml"))["train"]["lr"] == 0.01
    resume = [e for e in read_events(trained / "heartbeat_rank0.jsonl") if e["event"] == "resume"]
    assert resume[-1]["changed"] == {"train.steps": [6, 9], "train.lr": [0.002, 0.01], "train.warmup_steps": [4, 2],
                                     "checkpoint.every": [3, 0]}
    assert "resumed with changed settings (applied from step 6): train.steps 6 -> 9" in capsys.readouterr().out


@pytest.mark.parametrize("piece,damage,problem", [
    ("COMPLETE.json", "truncate", "COMPLETE.json cannot be read"),
    (".metadata", "truncate", "where"),
    ("__0_0.distcp", "truncate", "where"),
    ("rank0.pt", "corrupt", "does not match its checksum"),
    ("rank0.pt", "delete", "is missing"),
])
def test_a_damaged_checkpoint_is_named_with_the_previous_one_to_use(trained, capsys, piece, damage, problem):
    last = trained / "checkpoints" / "step_00000006"
    path = last / piece
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    previous = trained / "checkpoints" / "step_00000003"
    want = f"nsa: error: checkpoint {last} is damaged: "
    fix = f"use the previous checkpoint {previous} (to resume training from it: checkpoint.resume={previous})"
    for command in (["train", *TINY, f"train.out_dir={trained.parent}", "train.run_name=r", "train.steps=9"],
                    ["generate", str(trained), "--max-new-tokens", "2"],
                    ["export", str(trained), str(trained.parent / "w.safetensors")]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(want) and problem in err and fix in err and len(err.strip().splitlines()) == 1, err
    # The named fix works: training resumes from the previous checkpoint.
    assert main(["train", *TINY, f"train.out_dir={trained.parent}", "train.run_name=r", "train.steps=9",
                 f"checkpoint.resume={previous}"]) == 0
    assert checkpoint.read_meta(checkpoint.latest(trained))["step"] == 9


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, capsys):
    assert main(["train", *TINY, f"train.out_dir={tmp_path}", "train.run_name=bad", "data.source=text",
                 f"data.path={tmp_path}"]) == 2  # an empty folder: no text to train on
    assert "nsa: error:" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def in_private_mounts(script: str, tmp_path: Path) -> None:
    """Run a bash script as root of new user and mount namespaces, where it may mount a small tmpfs (a disk that
    fills up) or a read-only view of a folder without privileges; its mounts vanish with it."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespaces here (unshare: {probe.stderr.decode().strip()})")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-euc", script],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _train_command(*args: str) -> str:
    code = f"import sys; from nsa.cli import main; sys.exit(main(['train', *{TINY + list(args)!r}]))"
    return f"{sys.executable} -c \"{code}\""


def test_a_full_disk_stops_with_the_cause_and_the_run_resumes_exactly_once_space_is_freed(
        tmp_path, uninterrupted_run, uninterrupted):
    final = checkpoint.latest(uninterrupted_run)
    size = sum(p.stat().st_size for p in final.iterdir())
    disk, keep = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    args = (f"train.out_dir={disk}", "train.run_name=r", "train.steps=24", "checkpoint.every=4")
    # Room for one checkpoint and the run's small files, not for two checkpoints.
    in_private_mounts(f"""
mount -t tmpfs -o size={int(size * 1.5) + 65536} tmpfs {disk}
set +e
{_train_command(*args)} > full.out 2> full.err; echo $? > full.rc
set -e
mount -o remount,size=64m {disk}
{_train_command(*args)} > freed.out 2> freed.err; echo $? > freed.rc
cp -r {disk}/r {keep}
""", tmp_path)
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "2", err[-2000:]
    first = disk / "r" / "checkpoints" / "step_00000004"
    assert err.startswith("nsa: error: could not write ") and "no space left on the device" in err, err[-2000:]
    assert f"the latest complete checkpoint, {first}, is intact" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "freed.rc").read_text().strip() == "0", (tmp_path / "freed.err").read_text()[-2000:]
    assert losses(keep) == uninterrupted  # bit for bit across the failure


def test_a_read_only_run_folder_is_named_by_train_eval_and_report(tmp_path, uninterrupted_run):
    runs = tmp_path / "runs"
    runs.mkdir()
    subprocess.run(["cp", "-r", str(uninterrupted_run), str(runs / "r")], check=True)
    py = sys.executable
    in_private_mounts(f"""
mount --bind {runs} {runs}
mount -o remount,bind,ro {runs}
set +e
{_train_command(f"train.out_dir={runs}", "train.run_name=r", "train.steps=30")} > train.out 2> train.err
echo $? > train.rc
{py} -m nsa eval {runs}/r --tasks none --val-batches 1 > eval.out 2> eval.err; echo $? > eval.rc
{py} -m nsa report {runs}/r > report.out 2> report.err; echo $? > report.rc
{py} -m nsa report {runs}/r --out {tmp_path}/report > report2.out 2> report2.err; echo $? > report2.rc
""", tmp_path)
    results = {name: ((tmp_path / f"{name}.rc").read_text().strip(), (tmp_path / f"{name}.err").read_text())
               for name in ("train", "eval", "report", "report2")}
    rc, err = results["train"]
    assert rc == "2" and err.startswith(f"nsa: error: could not write {runs / 'r'}"), err[-2000:]
    assert "the filesystem is read-only; choose a writable train.out_dir" in err
    for name in ("eval", "report"):
        rc, err = results[name]
        assert rc == "2" and "is on a read-only filesystem: choose a writable folder" in err, (name, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err[-2000:])
    assert results["report2"][0] == "0" and (tmp_path / "report" / "report.md").is_file()


def test_ctrl_c_under_torchrun_stops_both_ranks_at_one_step_with_a_checkpoint(tmp_path):
    # Ctrl-C signals the whole foreground process group: torchrun and both ranks get SIGINT, and torchrun then
    # forwards its own copy to the ranks; one stop must come of it, agreed by both ranks.
    run_dir = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "nsa", "train",
           *TINY, f"train.out_dir={tmp_path}", "train.run_name=ddp", "train.steps=400", "train.batch_size=2"]
    proc = subprocess.Popen(cmd, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    wait_for(lambda: logged_step(run_dir) >= 2, timeout=180, what="step 2")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    saved = checkpoint.latest(run_dir)
    assert saved is not None, err[-3000:]
    stopped = checkpoint.read_meta(saved)["step"]
    assert f"nsa: stopped at step {stopped} on SIGINT; checkpoint: {saved}" in err, err[-3000:]
    assert "again: exiting now" not in err
    for rank in (0, 1):
        events = read_events(run_dir / f"heartbeat_rank{rank}.jsonl")
        assert [(e["step"], e["reason"]) for e in events if e["event"] == "halt"] == [(stopped, "SIGINT")], rank
        assert (saved / f"rank{rank}.pt").is_file()


def test_damaged_run_files_are_named_by_report_and_half_lines_are_skipped(trained, capsys, tmp_path):
    with open(trained / "heartbeat_rank0.jsonl", "a") as f:
        f.write('{"broken\n{"time": 1, "event": "half')  # a damaged line, then a half-written last one
    assert main(["report", str(trained), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert f"warning: {trained / 'heartbeat_rank0.jsonl'}: skipped 1 unreadable line" in err
    (trained / "metrics.csv").write_bytes(b"\x00\x9f\xff garbage\n")
    assert main(["report", str(trained), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nsa: error: '{trained / 'metrics.csv'}' is damaged: it has no 'step' column")


def test_damaged_token_shards_are_named_with_the_fix(tmp_path, capsys):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("In the beginning was the word. " * 400)
    shards = tmp_path / "shards"
    assert main(["prepare", "data.source=text", f"data.path={text}", "--out", str(shards)]) == 0
    capsys.readouterr()
    train_args = ["train", *TINY, f"train.out_dir={tmp_path}", "train.steps=1", "data.source=shards",
                  f"data.path={shards}"]
    shard = sorted(shards.glob("train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert main(train_args) == 2
    err = capsys.readouterr().err
    assert f"shard '{shard}' is damaged: it holds" in err and "re-run `nsa prepare`" in err
    (shards / "meta.json").write_text('{"tokenizer": "by')
    assert main(train_args) == 2
    assert f"'{shards / 'meta.json'}' is damaged" in capsys.readouterr().err
