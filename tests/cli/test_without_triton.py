"""Without triton installed (a CPU machine after the README's first command), no CPU path imports it: the model
trains and decodes with phi 'mlp' and 'mean', and `nsa train` runs in a fresh virtual environment."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_readme import bash_blocks

ROOT = Path(__file__).resolve().parents[2]

# A process in which `import triton` fails as it does where the package is absent.
BLOCK_TRITON = textwrap.dedent("""
    import importlib.abc
    import sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
""")

MODEL_WITHOUT_TRITON = BLOCK_TRITON + textwrap.dedent("""
    import dataclasses

    import torch

    from nsa.errors import ConfigError
    from nsa.inference.generate import generate, generate_uncached
    from nsa.model import Transformer, tiny
    from nsa.ops.api import resolve_backend
    from nsa.ops.triton import installed
    from nsa.telemetry.health import probe

    assert not installed()
    for phi in ("mlp", "mean"):
        cfg = dataclasses.replace(tiny(), vocab_size=64, n_layers=2)
        cfg = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, phi=phi))
        torch.manual_seed(0)
        model = Transformer(cfg)
        tokens = torch.randint(0, 64, (2, 41))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters()), phi
        model.eval()
        with torch.no_grad():
            want = generate_uncached(model, tokens[0, :20], 12, context=64, temperature=0)[0]
        assert generate(model, tokens[0, :20].tolist(), 12, temperature=0) == [want], phi
        assert probe(model, tokens[:1, :40])["gate_count"].sum() > 0, phi
    try:
        resolve_backend("triton", torch.device("cpu"), 10)
    except ConfigError as e:
        assert "model.nsa.backend=auto" in str(e), e
    else:
        raise AssertionError("backend='triton' ran without triton")
    kernel_modules = ("nsa.ops.triton.", "nsa.ops.gluon", "nsa.ops.dispatch", "nsa.ops.custom_ops")
    kernels = sorted(name for name in sys.modules if name.startswith(kernel_modules))
    assert not kernels and "triton" not in sys.modules, (kernels, sys.modules.get("triton"))
    print("ok")
""")


def test_the_model_trains_and_decodes_on_cpu_where_triton_cannot_be_imported():
    result = subprocess.run([sys.executable, "-c", MODEL_WITHOUT_TRITON], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def readme_train_command() -> tuple[list[str], list[str]]:
    """The README's first command, `pip install ... && nsa train`, as pip's arguments and the nsa command."""
    install, command = bash_blocks((ROOT / "README.md").read_text())[0].split(" && ")
    assert install.startswith("pip install ") and command == "nsa train"
    return install.split()[2:], command.split()


@pytest.mark.slow
def test_the_readmes_first_command_trains_in_a_fresh_environment_without_triton(tmp_path):
    pip_args, command = readme_train_command()
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        # --no-compile: the same install, without first writing bytecode for each of torch's many files.
        install = subprocess.run([str(python), "-m", "pip", "install", "--no-compile", *pip_args], cwd=ROOT,
                                 capture_output=True, text=True, timeout=900)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
        probe = subprocess.run([str(python), "-c", "import triton"], capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "No module named 'triton'" in probe.stderr, probe.stderr

        runs = tmp_path / "runs"
        train = subprocess.run([str(venv / "bin" / command[0]), *command[1:], "train.steps=3",
                                "train.sample_tokens=5", "train.eval_every=0", f"train.out_dir={runs}",
                                "train.run_name=first"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert train.returncode == 0, train.stderr[-3000:]
        assert "done: step 3" in train.stdout and (runs / "first" / "metrics.csv").exists(), train.stdout[-2000:]
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about a gigabyte
