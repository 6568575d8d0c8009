"""A second CUDA stream for the NSA branches whose kernels do not depend on each other.

The compressed branch (its forward and block choice, its dK/dV) and the window's dK/dV depend on neither the
window forward nor the selected branch. Queued on a side stream, they run beside those, so the GPU is not left
idle between one kernel's last programs and the next kernel's first (measured: docs/experiments.md;
the branches' big kernels already fill the SMs, so it is the gaps that shrink, not the compressed work).
The selected branch's float32 dK/dV sums are converted there too, beside dQ (`Beside.follow` forks again).
Off CUDA (the interpreter) everything runs in order on the one stream, as it would without this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from .tuning import TUNING

R = TypeVar("R")
_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


class Beside:
    """Work of one NSA call (on queries q) queued beside the current stream. Creating one forks (the side stream
    waits for all queued so far); `join` makes the current stream wait for the side's work and hands its tensors
    over to it. Work queued after a join runs beside what the current stream does next, until the next join."""

    def __init__(self, q: Tensor):
        # Not for small calls (TUNING.branch_streams_min_elements: the streams' host bookkeeping would cost more
        # than the overlap gains), except while a CUDA graph is captured: the fork and join become edges of the
        # graph, its replays pay no host time for them, and small calls are where the branches leave most SMs
        # idle. A side stream joined to the capture allocates from the graph's pool, and record_stream defers the
        # reuse of its outputs' memory until the capture ends.
        device = q.device
        on = device.type == "cuda" and TUNING.branch_streams
        self.on = on and (q.numel() >= TUNING.branch_streams_min_elements or torch.cuda.is_current_stream_capturing())
        self.main = torch.cuda.current_stream(device) if self.on else None
        self.side = _side_stream(device) if self.on else None
        self.outputs: list[Tensor] = []
        if self.on:
            self.side.wait_stream(self.main)

    def run(self, fn: Callable[..., R], *args, **kwargs) -> R:
        """fn(*args) queued on the side stream (or run in place when off); its returned tensors are kept for
        `join`. Inputs must stay alive until `join`: the caller holds them."""
        if not self.on:
            return fn(*args, **kwargs)
        with torch.cuda.stream(self.side):
            out = fn(*args, **kwargs)
        self.outputs.extend(_tensors(out))
        return out

    def follow(self, *inputs: Tensor) -> None:
        """Make the side stream wait for all queued so far on the current one, so that work queued next may read
        `inputs`, made there: their memory is not handed out again until the side stream is done with them."""
        if not self.on:
            return
        self.side.wait_stream(self.main)
        for t in inputs:
            t.record_stream(self.side)

    def join(self) -> None:
        if not self.on:
            return
        self.main.wait_stream(self.side)
        # Allocated on the side stream, used and freed on the main one: the allocator must not hand their
        # memory to the side stream again before the main stream is done with them.
        for t in self.outputs:
            t.record_stream(self.main)
        self.outputs = []


def _tensors(out) -> Sequence[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []
