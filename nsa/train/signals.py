"""SIGINT and SIGTERM during training: the first asks the run to stop at the next step boundary that every rank
agrees on (nsa.train.stop), with a checkpoint; a second one ends the process at once.

Schedulers (Slurm, Kubernetes) send SIGTERM before they kill a job, and Ctrl-C sends SIGINT to every process of
the terminal's foreground group. The signal is noticed by a listener thread through `signal.set_wakeup_fd`, so a
second signal ends the process even while the main thread is blocked inside a collective or a GPU wait.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

REPEAT_AFTER_S = 1.0
"""A signal this soon after the first is the same request: launchers (torchrun, Slurm) forward to their workers the
signal those workers already got from the terminal or the scheduler."""


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by signal `signum` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class StopSignals:
    """While active (a context manager, on the main thread), SIGINT and SIGTERM set `received` instead of raising
    KeyboardInterrupt or ending the process; a second signal, at least REPEAT_AFTER_S later, exits at once with
    128 + signum (the last complete checkpoint stands: checkpoints are written to a temporary folder first).

    `on_first(signum)` runs on the listener thread when the first signal arrives (e.g. to record an event)."""

    def __init__(self, on_first: Callable[[int], None] | None = None):
        self.received = 0
        """The first stop signal's number, 0 while none has arrived."""
        self._on_first = on_first
        self._first_time = 0.0
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread; the defaults stay
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        for signum in STOP_SIGNALS:
            # The Python-level handler does nothing: the C-level handler it installs writes the signal number to
            # the wakeup socket, which the listener thread reads even while the main thread is blocked.
            self._previous[signum] = signal.signal(signum, _ignore)
        self._previous_wakeup = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._listen, name="nsa-stop-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._writer.close()  # ends the listener's recv
        self._thread.join(timeout=5)
        self._reader.close()
        self._thread = None

    def _listen(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self._first_time = signum, now
            if self._on_first is not None:
                self._on_first(signum)
        elif now - self._first_time >= REPEAT_AFTER_S:
            _write_line(f"nsa: {signal.Signals(signum).name} again: exiting now; the last complete checkpoint "
                        "stands")
            os._exit(exit_code(signum))


def _ignore(signum, frame) -> None:
    """The Python-level handler of a stop signal: the listener thread acts on it."""


def _write_line(text: str) -> None:
    """One line to stderr, written straight to the descriptor (no buffer that a closed pipe could jam)."""
    try:
        os.write(sys.stderr.fileno(), (text + "\n").encode())
    except (OSError, ValueError, AttributeError):
        pass
