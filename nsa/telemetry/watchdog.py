"""Stall watchdog and on-demand stack dumps.

A daemon thread watches the time since the training loop last reported progress. After
`stall_timeout_s` without progress it writes every thread's Python stack to
<run dir>/stacks_rank{r}.txt and records a 'stall' heartbeat, once per stall (training is left
alone: a collective timeout or the user decides what happens next). `kill -USR1 <pid>` writes the
same dump at any time; faulthandler does it from C, so it works even while Python is blocked.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
import time
from pathlib import Path

from .heartbeat import Heartbeat


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, stall_timeout_s: float, heartbeat: Heartbeat | None):
        self.path = Path(run_dir) / f"stacks_rank{rank}.txt"
        self.timeout_s = stall_timeout_s
        self.heartbeat = heartbeat
        self.step = 0
        self.stalls = 0
        self._last_progress = time.monotonic()
        self._reported = False
        self._stop = threading.Event()
        self._file = open(self.path, "a", encoding="utf-8")
        self._thread = None
        self._signal_installed = False
        if stall_timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name=f"watchdog-rank{rank}", daemon=True)
            self._thread.start()

    def progress(self, step: int) -> None:
        """Called by the training loop after every step: two attribute writes, no system call."""
        self.step = step
        self._last_progress = time.monotonic()

    def install_signal_handler(self) -> None:
        """SIGUSR1 dumps every thread's stack to the stacks file (main thread only; Unix only)."""
        if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, self._on_signal)  # runs when Python gets control: records the event
        faulthandler.register(signal.SIGUSR1, file=self._file, all_threads=True, chain=True)  # dumps at once
        self._previous_handler, self._signal_installed = previous, True

    def _on_signal(self, signum, frame) -> None:
        if self.heartbeat:
            self.heartbeat.event("dump", self.step, reason="SIGUSR1", path=str(self.path))

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 4, 0.05), 5.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last_progress
            if idle < self.timeout_s:
                self._reported = False
            elif not self._reported:
                self._reported = True
                self.stalls += 1
                self.dump(f"no step finished for {idle:.0f}s after step {self.step}")
                if self.heartbeat:
                    self.heartbeat.event("stall", self.step, seconds=round(idle, 1), path=str(self.path))

    def dump(self, reason: str) -> None:
        self._file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {reason} ===\n")
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._signal_installed:
            faulthandler.unregister(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, self._previous_handler)
        self._file.close()
