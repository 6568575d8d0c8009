"""Work queued on a second CUDA stream, beside the current one, for NSA stages that do not depend on each other.

The compressed branch (its forward and block choice, its dK/dV) and the window's dK/dV depend on neither the
window forward nor the selected branch. Queued on a side stream, they run beside those, so the GPU is not left
idle between one kernel's last programs and the next kernel's first (the branches' big kernels already fill the
SMs: it is the gaps that shrink). Whether a call uses it is nsa.ops.dispatch.side_stream's choice; a disabled
SideStream runs everything in order on the current stream, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

R = TypeVar("R")
_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


class SideStream:
    """The work of one NSA call queued on a side CUDA stream of `device`. Creating an enabled one forks (the side
    stream waits for all queued so far); `join` makes the current stream wait for the side's work and hands its
    tensors over to it. Work queued after a join runs beside what the current stream does next, until the next
    join. Disabled, `run` calls in place and the rest does nothing.

    Inside a CUDA graph capture the fork and join become edges of the graph; a side stream joined to the capture
    allocates from the graph's pool, and record_stream defers the reuse of its outputs' memory until the capture
    ends."""

    def __init__(self, device: torch.device, enabled: bool):
        self.on = enabled
        self.main = torch.cuda.current_stream(device) if enabled else None
        self.side = _side_stream(device) if enabled else None
        self.outputs: list[Tensor] = []
        if enabled:
            self.side.wait_stream(self.main)

    def run(self, fn: Callable[..., R], *args, **kwargs) -> R:
        """fn(*args) queued on the side stream (or run in place when disabled); its returned tensors are kept for
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
        """The current stream waits for the side's work; the side's outputs belong to the current stream."""
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
