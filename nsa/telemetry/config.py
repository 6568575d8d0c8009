"""Telemetry configuration: run artifacts, NSA health statistics, the watchdog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TelemetryConfig:
    """What a run records about itself and how it reacts when it stops making progress."""

    tensorboard: bool = True
    """Write TensorBoard scalars to <run dir>/tb (rank 0): `tensorboard --logdir runs`."""
    wandb: bool = False
    """Also log to Weights & Biases (rank 0), beside TensorBoard: the same scalars under the same names and
    steps, and the run's config. Needs `pip install -e ".[wandb]"`. The W&B run id is kept in <run dir>/wandb_id,
    so a resumed run continues the same W&B run."""
    wandb_project: str = "nsa"
    """W&B project that receives the run."""
    wandb_run_name: str = ""
    """W&B display name of the run; empty uses the run folder's name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """'online' streams to the W&B server (log in first: `wandb login`); 'offline' writes under <run dir>/wandb
    for a later `wandb sync`; 'disabled' makes every W&B call a no-op."""
    health_every: int = 50
    """NSA health statistics (gates per branch, selection reach) every this many steps (on the logging step at or
    after it, and at the first and last step), into nsa_stats.jsonl; 0 disables. Each costs one no-grad forward
    of telemetry.health_tokens tokens."""
    health_tokens: int = 2048
    """Tokens of one training sequence that the health probe runs on (its cost grows with this)."""
    stall_timeout_s: float = 600.0
    """No step finished for this long: dump every thread's stack on every rank into the run folder and
    record a 'stall' heartbeat (training goes on); 0 disables. Include first-step compilation time."""
    gate_collapse: float = 0.02
    """Warn when a branch's mean gate in some layer falls below this or rises above 1 minus this."""
    gate_flat_steps: int = 1000
    """Warn when no gate mean of any layer moved by 1e-3 over this many steps; 0 disables."""
