"""Stop requests agreed by every rank without a host sync on the training step.

Each step every rank contributes whether it sees a HALT file in the run folder, the stop signal it received
(SIGINT or SIGTERM, 0 if none; nsa.train.signals) and the first step whose loss or gradient norm was non-finite
(-1 if none). The maximum over ranks is all-reduced
asynchronously and copied to pinned host memory; the answer for step i is read at step i + LAG,
when it has long arrived. Every rank therefore stops at the same step, and none waits for the GPU.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .distributed import DistInfo

LAG = 2
"""Steps between a request and the decision: enough for the tiny all-reduce to finish in the background."""


@dataclass
class StopDecision:
    halt_file: bool
    """Some rank saw the HALT file."""
    signal: int
    """The stop signal some rank received (the highest number when they differ), or 0."""
    bad_step: int
    """The first step with a non-finite loss or gradient norm on any rank, or -1."""

    @property
    def stop(self) -> bool:
        return self.halt_file or self.signal > 0 or self.bad_step >= 0


class StopRequests:
    def __init__(self, halt_path: Path, info: DistInfo):
        self.halt_path, self.info = halt_path, info
        self._pending: collections.deque = collections.deque()

    def submit(self, step: int, bad_step: torch.Tensor, signal: int = 0) -> None:
        """Queue this step's request; bad_step is a 0-d int64 device tensor (-1 when all is finite), signal the stop
        signal this rank received (0: none)."""
        # Filled on the device (no copy from pageable host memory, which could wait for the GPU).
        seen = torch.full((), int(self.halt_path.exists()), dtype=torch.long, device=bad_step.device)
        signalled = torch.full((), signal, dtype=torch.long, device=bad_step.device)
        request = torch.stack([seen, signalled, bad_step])
        work = dist.all_reduce(request, op=dist.ReduceOp.MAX, async_op=True) if self.info.distributed else None
        if request.is_cuda:
            if work is not None:
                work.wait()  # orders the copy after the reduction on the GPU; the host does not wait
            host = torch.empty(3, dtype=torch.long, pin_memory=True)
            host.copy_(request, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending.append((step, host, done, None))
        else:
            self._pending.append((step, request, None, work))

    def settle(self) -> None:
        """Wait for every queued request. A run that stops early leaves later ones queued, and async work never
        waited for can abort the process when the process group goes away."""
        self.decision(0, final=True)

    def decision(self, step: int, final: bool = False) -> StopDecision | None:
        """The decision due at this step (requested LAG steps ago), or with final=True all pending ones
        combined; None when none is due. Every rank must call this at the same steps."""
        halt, signal, bad = False, 0, -1
        due = False
        while self._pending and (final or self._pending[0][0] <= step - LAG):
            _, values, done, work = self._pending.popleft()
            if done is not None:
                done.synchronize()
            elif work is not None:
                work.wait()
            seen, signalled, first_bad = values.tolist()
            halt, signal, bad = halt or bool(seen), max(signal, signalled), first_bad if bad < 0 else bad
            due = True
        return StopDecision(halt, signal, bad) if due else None
