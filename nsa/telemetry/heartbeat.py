"""Per-rank heartbeat: one JSON line per event, written by a background thread.

Events: boot, resume, step, eval, checkpoint, warning, halt, stall, dump, done. Writing happens off the
training thread, so a slow filesystem never delays a step, and the watchdog can record a stall while
the training thread is stuck.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

_STOP = object()


class Heartbeat:
    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.last_event: dict | None = None
        self._queue: queue.Queue = queue.Queue()
        self._file = open(path, "a", encoding="utf-8")
        self._thread = threading.Thread(target=self._write_loop, name=f"heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def event(self, name: str, step: int, **fields) -> None:
        record = {"time": round(time.time(), 3), "event": name, "rank": self.rank, "step": step}
        record.update({k: v for k, v in fields.items() if v is not None})
        self.last_event = record
        self._queue.put(record)

    def _write_loop(self) -> None:
        while (record := self._queue.get()) is not _STOP:
            self._file.write(json.dumps(record, default=_plain) + "\n")
            if self._queue.empty():
                self._file.flush()
        self._file.flush()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10)
        self._file.close()


def _plain(value):
    """JSON for tensors and numpy scalars that slipped into a record."""
    return value.item() if hasattr(value, "item") else str(value)


def read_events(path: Path) -> list[dict]:
    """The events of a heartbeat file (a partly written last line is skipped)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
