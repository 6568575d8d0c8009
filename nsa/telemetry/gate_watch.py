"""Warnings about gates that stopped doing their job: collapsed to 0 or 1, or not moving at all."""

from __future__ import annotations

from .run_files import BRANCH_NAMES


class GateWatch:
    """Checks each nsa_stats record; every distinct warning is given once per run."""

    def __init__(self, collapse: float, flat_steps: int, flat_tolerance: float = 1e-3):
        self.collapse, self.flat_steps, self.flat_tolerance = collapse, flat_steps, flat_tolerance
        self._given: set[str] = set()
        self._reference: tuple[int, list[list[float]]] | None = None

    def check(self, step: int, record: dict) -> list[str]:
        means = [layer["gate_mean"] for layer in record["layers"]]
        return [w for w in self._collapsed(means) + self._flat(step, means) if self._first_time(w)]

    def _collapsed(self, means: list[list[float]]) -> list[str]:
        out = []
        for layer, gates in enumerate(means):
            for branch, g in zip(BRANCH_NAMES, gates):
                if g < self.collapse or g > 1 - self.collapse:
                    out.append(f"layer {layer}: the {branch} gate collapsed to {g:.3f} (mean over heads and tokens)")
        return out

    def _flat(self, step: int, means: list[list[float]]) -> list[str]:
        if self.flat_steps <= 0:
            return []
        if self._reference is None:
            self._reference = (step, means)
            return []
        start, first = self._reference
        moved = max(abs(a - b) for old, new in zip(first, means) for a, b in zip(old, new))
        if moved >= self.flat_tolerance:
            self._reference = (step, means)  # the gates move: watch again from here
            return []
        if step - start < self.flat_steps:
            return []
        return [f"no gate mean moved by {self.flat_tolerance:g} in {step - start} steps (steps {start}-{step}): "
                "the gates are not learning; check the gate MLP's learning rate and initialisation"]

    def _first_time(self, warning: str) -> bool:
        key = warning.split(" collapsed")[0] if " collapsed" in warning else "flat"
        if key in self._given:
            return False
        self._given.add(key)
        return True
