"""benchmarks/offline_compile.py keeps up with the kernels: it must build every kernel it lists for sm_90."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_offline_compile_builds_every_listed_kernel_for_sm90():
    # benchmarks/offline_compile.py names each kernel's arguments: a kernel whose signature changed must be
    # updated there too. It compiles for sm_90 with Triton's own ptxas (no GPU), outside the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "offline_compile.py"), "all"], capture_output=True,
                         text=True, env=env, timeout=600, cwd=BENCHMARKS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = re.findall(r"registers \d+  spill stack \d+ B  LDL/STL \d+  shared \d+ B  SASS \d+", out.stdout)
    assert len(reports) == len(_script("offline_compile").KERNELS), out.stdout
    # Atomic adds are relaxed: an acq_rel one (Triton's default) fences the whole GPU around each instruction.
    fences = re.findall(r"GPU fences (\d+)", out.stdout)
    assert len(fences) == len(reports) and set(fences) == {"0"}, out.stdout
