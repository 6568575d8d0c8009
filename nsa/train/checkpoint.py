"""Checkpoints written atomically: a crash or Ctrl-C mid-save leaves the previous file intact."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import UserError


def save_atomic(state: dict, path: Path) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("step_*.pt")) or sorted((path / "checkpoints").glob("step_*.pt"))
        if not candidates:
            raise UserError(f"no checkpoint (step_*.pt) found in '{path}'")
        path = candidates[-1]
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    return torch.load(path, map_location=map_location, weights_only=False)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}.pt"
