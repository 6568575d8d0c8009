"""Facts about the software and hardware a run or benchmark used (written to env.json, bench results)."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch


def git_revision() -> str:
    """The short commit of the nsa checkout (with '+dirty' for local changes), or 'unknown'."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "numpy", "datasets", "tiktoken", "fla"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "installed")
        except ImportError:
            out[name] = None
    return out


def gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def run_environment(config: dict, world_size: int) -> dict:
    """Everything env.json holds: when, where, what software, which command, the resolved config."""
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": socket.gethostname(),
        "world_size": world_size,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git": git_revision(),
        "versions": versions(),
        "gpus": gpus(),
        "config": config,
    }
