"""Weights & Biases as a second scalar sink beside TensorBoard (telemetry.wandb, rank 0 only).

The W&B run id is written to <run dir>/wandb_id when the run first starts and read back on every resume, so all
launches of one run folder log into one W&B run.
"""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import UserError

RUN_ID_FILE = "wandb_id"
INSTALL_HINT = 'pip install -e ".[wandb]" (or pip install wandb)'


def require_wandb() -> ModuleType:
    """The wandb module, or a one-line error naming the install command."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise UserError(f"telemetry.wandb=true needs the wandb package: {INSTALL_HINT}, or set "
                        "telemetry.wandb=false") from None


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run folder, created and stored on first use."""
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored
    new = uuid.uuid4().hex[:12]
    path.write_text(new + "\n", encoding="utf-8")
    return new


class WandbRun:
    """One W&B run fed with {name: value} scalars at training steps."""

    def __init__(self, run_dir: Path, config: dict, project: str, name: str, mode: str):
        wandb = require_wandb()
        try:
            self.run = wandb.init(project=project, name=name or run_dir.name, id=run_id(run_dir), resume="allow",
                                  mode=mode, dir=str(run_dir), config=config)
        except getattr(wandb, "Error", RuntimeError) as e:
            raise UserError(f"W&B could not start the run ({e}); log in with `wandb login`, or set "
                            "telemetry.wandb_mode=offline (sync later with `wandb sync`)") from None

    def log(self, scalars: dict[str, Any], step: int) -> None:
        # W&B keeps the highest step it has seen and drops rows below it, so the steps a crash logged after the
        # last checkpoint are not rewritten after a resume (TensorBoard purges them instead).
        if scalars:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
