"""The entry points in benchmarks/: ab.py's arguments, arithmetic, revision export and both processes (on the CPU,
where it runs the PyTorch reference); the shell scripts' argument handling; gpu_check.sh's test list."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _ab():
    spec = importlib.util.spec_from_file_location("bench_ab", BENCHMARKS / "ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ab = _ab()


# ------------------------------------------------------------------------------------------------------ ab.py


def test_cases_name_a_shape_or_its_heads_and_a_size():
    assert ab.parse_case("m7c:2048x16") == ab.Case("m7c", 12, 2, 64, 2048, 16)
    assert ab.parse_case("paper:65536x1") == ab.Case("paper", 64, 4, 128, 65536, 1)
    assert ab.parse_case("16/4/32:512x3") == ab.Case("16/4/32", 16, 4, 32, 512, 3)
    for bad, message in (("m7c:2048", "SHAPE:TxB"), ("big:2048x1", "m7c, paper or H/G/D"),
                         ("12/5/64:256x1", "must divide"), ("m7c:0x4", "positive")):
        with pytest.raises(ValueError, match=message):
            ab.parse_case(bad)


def test_a_param_gives_two_variants_typed_like_the_field():
    defaults = {"branch_streams": True, "gluon_stages": 3}
    a, b = ab.parse_param("gluon_stages=2,4", defaults)
    assert (a.settings, b.settings) == ((("gluon_stages", 2),), (("gluon_stages", 4),))
    assert a.revision is None and a.label == "gluon_stages=2"
    a, b = ab.parse_param("branch_streams=off,True", defaults)
    assert (a.settings, b.settings) == ((("branch_streams", False),), (("branch_streams", True),))
    for bad, message in (("nope=1,2", "not a field of TUNING"), ("gluon_stages=2", "two values"),
                         ("gluon_stages=2,x", "not an integer"), ("branch_streams=yes,no", "not a boolean"),
                         ("gluon_stages=3,3", "the same")):
        with pytest.raises(ValueError, match=message):
            ab.parse_param(bad, defaults)


def test_every_tuning_field_can_be_a_param():
    defaults = ab.tuning_defaults()
    assert defaults["branch_streams"] is True and isinstance(defaults["gluon_stages"], int)
    for name, default in defaults.items():
        other = (not default) if isinstance(default, bool) else default + 1
        a, b = ab.parse_param(f"{name}={default},{other}", defaults)
        assert (a.settings[0][1], b.settings[0][1]) == (default, other)


def test_the_command_line_is_checked_before_anything_runs(capsys):
    args, cases, variants = ab.parse_args(["out", "--revisions", "HEAD~1", "worktree", "--cases", "m7c:256x2"])
    assert variants == (ab.Variant("HEAD~1", "HEAD~1"), ab.Variant("worktree", "worktree"))
    assert cases == [ab.Case("m7c", 12, 2, 64, 256, 2)] and args.timing == "queued" and args.rounds == 6
    for argv, message in ((["out"], "one of the arguments --revisions --param is required"),
                          (["out", "--revisions", "a", "a"], "both are 'a'"),
                          (["out", "--param", "gluon_stages=2,3", "--cases", "m7c:1x"], "SHAPE:TxB"),
                          (["out", "--param", "gluon_stages=2,3", "--rounds", "0"], "at least 1"),
                          (["out", "--param", "gluon_stages=2,3", "--timing", "graphs", "--device", "cpu"],
                           "needs --device cuda")):
        with pytest.raises(SystemExit) as stop:
            ab.parse_args(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith("ab.py: error: ") and message in err, (argv, err)


def test_rounds_alternate_and_the_ratio_is_of_the_medians():
    assert [ab.round_order(r) for r in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]
    a, b, ratio = ab.summarize([3.0, 1.0, 2.0, 100.0], [1.0, 1.5, 0.5])
    assert (a, b) == (2.5, 1.0) and ratio == 2.5


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_a_revision_is_exported_with_its_own_nsa(tmp_path):
    repo = tmp_path / "repo"
    (repo / "nsa").mkdir(parents=True)
    _git(repo, "init", "-q")
    for version in ("one", "two"):
        (repo / "nsa" / "__init__.py").write_text(f"VERSION = {version!r}\n")
        (repo / "other.txt").write_text(version)
        _git(repo, "add", ".")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", version)
    (repo / "nsa" / "__init__.py").write_text("VERSION = 'edited'\n")
    dest = tmp_path / "exports"
    first = ab.export_revision(repo, "HEAD~1", dest)
    assert first == dest / _git(repo, "rev-parse", "HEAD~1")
    assert (first / "nsa" / "__init__.py").read_text() == "VERSION = 'one'\n"
    assert not (first / "other.txt").exists()  # nsa/ alone
    assert (ab.export_revision(repo, "HEAD", dest) / "nsa" / "__init__.py").read_text() == "VERSION = 'two'\n"
    assert ab.export_revision(repo, "worktree", dest) == repo  # uncommitted edits included
    with pytest.raises(ValueError, match="'nope' is not a revision"):
        ab.export_revision(repo, "nope", dest)


def test_both_variants_run_in_turn_and_the_results_are_written(tmp_path):
    """Two processes on the CPU with two values of a TUNING field; each imports this tree's nsa."""
    command = [sys.executable, str(BENCHMARKS / "ab.py"), str(tmp_path / "out"), "--param", "gluon_stages=2,3",
               "--cases", "2/1/16:64x1", "--device", "cpu", "--rounds", "2", "--reps", "1"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"nsa from {ROOT / 'nsa'}" in out.stdout
    saved = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert saved["environment"]["a"] == "gluon_stages=2" and saved["environment"]["b"] == "gluon_stages=3"
    rows = saved["rows"]
    assert [(r["case"], r["pass"]) for r in rows] == [("2/1/16:64x1", "fwd"), ("2/1/16:64x1", "fwd+bwd")]
    for row in rows:
        a, b = ([float(x) for x in row[f"{side}_samples"].split()] for side in "ab")
        assert len(a) == len(b) == 2 and min(a + b) > 0
        assert row["a/b"] == pytest.approx(ab.statistics.median(a) / ab.statistics.median(b), rel=1e-3)
    assert (tmp_path / "out" / "ab.csv").read_text().startswith("case,pass,a_ms,b_ms,a/b")


def test_a_variant_that_cannot_start_stops_the_run_in_one_line(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "ab.py"), str(tmp_path / "out"), "--param", "gluon_stages=2,3",
               "--cases", "2/1/16:64x1", "--device", "cuda"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a machine with one
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("ab.py: error: variant gluon_stages=2: ValueError: no CUDA")
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------- the shell scripts


def _bash(script: str, *args: str, path_first: Path | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path_first:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    return subprocess.run(["bash", str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def no_gpu(tmp_path) -> Path:
    """A folder whose nvidia-smi fails, as on a machine without a GPU."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (folder / "nvidia-smi").chmod(0o755)
    return folder


@pytest.mark.parametrize("script,args,message", [
    ("gpu_check.sh", [], "usage: bash benchmarks/gpu_check.sh OUT_DIR"),
    ("gpu_check.sh", ["{out}", "2048,8k"], "LENGTHS is a comma-separated list"),
    ("gpu_check.sh", ["{out}", "2048"], "no CUDA GPU found"),
    ("two_gpus.sh", ["{out}"], "usage: bash benchmarks/two_gpus.sh OUT_DIR PART"),
    ("two_gpus.sh", ["{out}", "scale", "fast"], "unknown part 'fast'"),
    ("two_gpus.sh", ["{out}", "small"], "no CUDA GPU found"),
    ("retrieval_grid.sh", [], "usage: bash benchmarks/retrieval_grid.sh OUT_DIR"),
    ("retrieval_grid.sh", ["{out}", "--reruns", "0"], "--reruns takes a positive number"),
    ("retrieval_grid.sh", ["{out}", "--gpus", "a,b"], "--gpus takes GPU indices"),
    ("retrieval_grid.sh", ["{out}"], "no CUDA GPU found"),
    ("recipes.sh", ["train", "{out}"], "usage: bash benchmarks/recipes.sh {learn|retrieval} OUT_DIR"),
    ("recipes.sh", ["learn"], "usage:"),
    ("recipes.sh", ["learn", "{out}", "--seeds", "0"], "--seeds takes a positive number"),
    ("recipes.sh", ["learn", "{out}", "--first-seed", "x"], "--first-seed takes a number"),
    ("recipes.sh", ["learn", "{out}", "--attention", "nsa,flex"], "--attention takes nsa, dense"),
    ("recipes.sh", ["retrieval", "{out}", "--stages", "256x4:10,512:10"], "--stages takes SEQxBATCH"),
    ("recipes.sh", ["retrieval", "{out}", "--extend"], "--extend needs a value"),
    ("recipes.sh", ["retrieval", "{out}", "--eval-tasks", "needle"], "--eval-tasks takes passkey, kv, multikey or a list"),
    ("recipes.sh", ["learn", "{out}", "--fast"], "unknown option '--fast'"),
    ("recipes.sh", ["retrieval", "{out}", "--from-stage", "0:model.nsa.gate_floor=0.02"], "--from-stage takes K:key=value"),
    ("recipes.sh", ["retrieval", "{out}", "--from-stage", "2:gate_floor"], "--from-stage takes K:key=value"),
    ("recipes.sh", ["retrieval", "{out}", "--through-stage", "0"], "--through-stage takes a stage number"),
    ("recipes.sh", ["retrieval", "{out}", "--through-stage", "7"], "--through-stage 7: the curriculum has 6 stages"),
    ("recipes.sh", ["learn", "{out}", "--through-stage", "1"], "--through-stage is for the retrieval recipe's stages"),
    ("recipes.sh", ["retrieval", "{out}", "--from-stage", "7:model.nsa.gate_floor=0.02"],
     "--from-stage 7: the curriculum has 6 stages"),
    ("recipes.sh", ["learn", "{out}", "--from-stage", "2:model.nsa.gate_floor=0.02"],
     "--from-stage is for the retrieval recipe's stages"),
    ("recipes.sh", ["learn", "{out}", "--", "train.steps"], "key=value overrides (got 'train.steps')"),
])
def test_scripts_refuse_bad_arguments_in_one_line(tmp_path, no_gpu, script, args, message):
    out = _bash(script, *(a.format(out=tmp_path / "out") for a in args), path_first=no_gpu)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


def test_the_retrieval_grid_spreads_seeds_and_reruns_over_the_gpus(tmp_path, no_gpu):
    out = _bash("retrieval_grid.sh", str(tmp_path / "grid"), "--seeds", "2", "--gpus", "0,3", "--dry-run", "--",
                "--eval-samples", "32", path_first=no_gpu)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    grid = tmp_path / "grid"
    assert len(lines) == 2 * 2 * 2  # seeds x reruns x (nsa, dense)
    assert lines[0] == f"GPU 0: nsa seed 1337 rerun 1 -> {grid}/nsa-1337-r1"
    assert {line.split(" -> ")[1] for line in lines} == {f"{grid}/{a}-{s}-r{k}" for a in ("nsa", "dense")
                                                          for s in (1337, 1338) for k in (1, 2)}
    assert {line.split(":")[0] for line in lines} == {"GPU 0", "GPU 3"} and not grid.exists()


def test_every_test_gpu_check_runs_exists():
    """gpu_check.sh names test files and single tests: each must still be collected."""
    text = (BENCHMARKS / "gpu_check.sh").read_text()
    tests = [word for word in shlex.split(text, comments=True) if word.startswith("tests/")]
    assert len(tests) >= 4 and "tests/ops/test_triton_gpu.py" in tests
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for test in tests:
        assert test in out.stdout, test


TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.mlp_hidden=64", "model.nsa.phi_hidden=16", "model.nsa.gate_hidden=8", "train.batch_size=2",
        "train.eval_every=2", "train.eval_batches=1", "train.log_every=1", "train.warmup_steps=1",
        "checkpoint.every=2", "telemetry.health_every=2", "train.device=cpu"]


@pytest.mark.slow
def test_the_learn_recipe_trains_evaluates_and_compares_both_models(tmp_path):
    out = _bash("recipes.sh", "learn", str(tmp_path / "runs"), "--", *TINY, "train.seq_len=128", "train.steps=4",
                "data.source=text", f"data.path={ROOT / 'README.md'}", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = tmp_path / "runs"
    for model in ("nsa", "dense"):
        assert (runs / f"learn-{model}-1337" / "eval" / "eval.csv").is_file()
    compare = (runs / "compare" / "compare.md").read_text()
    assert "learn-nsa-1337" in compare and "learn-dense-1337" in compare and "**Margin:**" in compare


@pytest.mark.slow
def test_the_retrieval_recipe_runs_its_curriculum_as_one_run(tmp_path):
    """Two stages of 2 steps (128 x 4, then 256 x 2 mixed with 512) and 2 more steps: one 6-step schedule; trained
    on both tasks and evaluated on both; the gate floor and a wider window from the second stage on. The first
    launch stops after the first stage (at the whole schedule's rates), the second goes on from there."""
    command = ["recipes.sh", "retrieval", str(tmp_path / "runs"), "--attention", "nsa", "--stages",
               "128x4:2,256x2+512:2", "--extend", "2", "--eval-lengths", "256,512", "--eval-samples", "1",
               "--eval-tasks", "passkey,kv", "--from-stage", "2:model.nsa.gate_floor=0.02",
               "--from-stage", "2:model.nsa.window=512"]
    overrides = ["--", *TINY, "data.retrieval.task=mixed", "model.nsa.window=64"]
    run = tmp_path / "runs" / "retrieval-nsa-1337"
    first = _bash(*command, "--through-stage", "1", *overrides, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["train"]["steps"], config["train"]["seq_len"], config["model"]["nsa"]["gate_floor"]) == (4, 128, 0)
    assert config["model"]["nsa"]["window"] == 64
    assert [r.split(",")[0] for r in (run / "metrics.csv").read_text().splitlines()[1:]] == ["1", "2"]
    out = _bash(*command, *overrides, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [int(r.split(",")[0]) for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert re.search(r"resumed with changed settings .*train\.seq_len 128 -> 256", out.stdout)
    assert re.search(r"resumed with changed settings \(applied from step 2\).*model\.nsa\.gate_floor 0\.0 -> 0\.02",
                     out.stdout)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["train"]["steps"], config["train"]["seq_len"], config["train"]["batch_size"]) == (6, 256, 2)
    assert config["data"]["retrieval"]["mix_lengths"] == [512] and config["model"]["nsa"]["gate_floor"] == 0.02
    assert config["model"]["nsa"]["window"] == 512 and re.search(r"model\.nsa\.window 64 -> 512", out.stdout)
    evaluated = (run / "eval" / "eval.csv").read_text()
    assert "passkey" in evaluated and "\nkv," in evaluated
    compared = (tmp_path / "runs" / "compare" / "compare.md").read_text()
    assert "retrieval-nsa-1337" in compared and "Lowest head's gate (" in compared  # the run's per-head records


def test_bench_results_go_to_a_git_ignored_folder_by_default():
    from nsa.cli import parse_args

    for kind in ("attention", "train", "decode"):
        assert parse_args(["bench", kind]).out == "runs/bench"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "runs/bench/attention.json"])
    assert ignored.returncode == 0


@pytest.mark.parametrize("script", ["host_profile.py", "launch_check.py"])
def test_launch_timing_scripts_say_in_one_line_that_they_need_a_gpu(tmp_path, script):
    # CI has no CUDA: the script must refuse before touching a kernel, with one line and exit status 2.
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=BENCHMARKS.parent, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == f"{script}: needs a CUDA GPU (it times kernel launches)"
    assert not (tmp_path / "out").exists()
