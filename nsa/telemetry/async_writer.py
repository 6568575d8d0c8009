"""One background thread per process that performs file writes, so that a slow filesystem never
delays a training step and a stuck training thread cannot keep the watchdog from writing."""

from __future__ import annotations

import queue
import threading
from typing import Callable

_STOP = object()


class AsyncWriter:
    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], None]) -> None:
        """Run write() on the writer thread, in submission order."""
        self._queue.put(write)

    def _loop(self) -> None:
        while (write := self._queue.get()) is not _STOP:
            write()

    def close(self) -> None:
        """Finish every submitted write, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
