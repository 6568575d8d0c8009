"""Telemetry configuration: run artifacts, NSA health statistics, the watchdog."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TelemetryConfig:
    """What a run records about itself and how it reacts when it stops making progress."""

    tensorboard: bool = True
    """Write TensorBoard scalars to <run dir>/tb (rank 0): `tensorboard --logdir runs`."""
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
