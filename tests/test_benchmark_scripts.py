"""benchmarks/ab_check.sh: the command runs on the working tree, then with the saved files swapped in, and the
tree is put back, also when the command fails; misuse stops with a one-line message."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ab_check.sh"


def _tree(tmp_path: Path) -> Path:
    """A minimal repository root: the env script ab_check sources and one module, with a saved older copy."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_env.sh", repo / "benchmarks" / "gpu_env.sh")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "mod.py").write_text("VERSION = 'after'\n")
    (repo / "ab" / "pkg").mkdir(parents=True)
    (repo / "ab" / "pkg" / "mod.py").write_text("VERSION = 'before'\n")
    return repo


def _run(repo: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *command], cwd=repo, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin:/usr/local/bin", "OUT": str(repo / "out"), "HOME": str(repo)},
                          timeout=60)


def test_both_sides_run_in_order_and_the_tree_is_restored(tmp_path):
    repo = _tree(tmp_path)
    show = "import sys; sys.path.insert(0, '.'); import pkg.mod; print(sys.argv[1], pkg.mod.VERSION)"
    result = _run(repo, "ab", "--", "python3", "-c", show, "{}")
    assert result.returncode == 0, result.stderr
    sides = [line for line in result.stdout.splitlines() if line.startswith(str(repo / "out"))]
    assert sides == [f"{repo / 'out' / 'after'} after", f"{repo / 'out' / 'before'} before"]
    assert (repo / "out" / "before" / "log.txt").read_text().strip().endswith("before")
    assert (repo / "pkg" / "mod.py").read_text() == "VERSION = 'after'\n"


def test_a_failing_command_still_restores_the_tree(tmp_path):
    repo = _tree(tmp_path)
    _run(repo, "ab", "--", "python3", "-c", "raise SystemExit(3)")
    assert (repo / "pkg" / "mod.py").read_text() == "VERSION = 'after'\n"


def test_misuse_is_refused_with_one_line(tmp_path):
    repo = _tree(tmp_path)
    (repo / "ab" / "pkg" / "extra.py").write_text("")
    result = _run(repo, "ab", "--", "true")
    assert result.returncode == 2 and "ab/pkg/extra.py has no counterpart" in result.stderr
    result = _run(repo, "missing", "--", "true")
    assert result.returncode == 2 and result.stderr.startswith("usage:")
