"""One background thread per process that performs file writes, so that a slow filesystem never
delays a training step and a stuck training thread cannot keep the watchdog from writing.

A write that fails (full disk, read-only folder) does not end the thread: the first failure is kept in
`failure` for the training thread to report, and later writes are still attempted."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable

_STOP = object()


class AsyncWriter:
    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self.failure: tuple[Path | str, OSError] | None = None
        """(the file, the error) of the first write that failed."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], None], path: Path | str = "a run file") -> None:
        """Run write() on the writer thread, in submission order; `path` names what it writes, for errors."""
        self._queue.put((write, path))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            write, path = item
            try:
                write()
            except OSError as e:
                if self.failure is None:
                    self.failure = (path, e)

    def close(self) -> None:
        """Finish every submitted write, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
