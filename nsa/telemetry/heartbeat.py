"""Per-rank heartbeat: one JSON line per event, written by a background thread.

Events: boot, resume, step, eval, checkpoint, warning, halt, stall, dump, done. Writing happens off the
training thread, so a slow filesystem never delays a step, and the watchdog can record a stall while
the training thread is stuck.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .async_writer import AsyncWriter


class Heartbeat:
    def __init__(self, path: Path, rank: int, writer: AsyncWriter | None = None):
        self.path, self.rank = path, rank
        self.last_event: dict | None = None
        self._own_writer = writer is None
        self._writer = writer or AsyncWriter(f"heartbeat-rank{rank}")
        self._file = open(path, "a", encoding="utf-8")

    def event(self, name: str, step: int, **fields) -> None:
        record = {"time": round(time.time(), 3), "event": name, "rank": self.rank, "step": step}
        record.update({k: v for k, v in fields.items() if v is not None})
        self.last_event = record
        line = json.dumps(record, default=_plain) + "\n"
        self._writer.submit(lambda: (self._file.write(line), self._file.flush()), self.path)

    def close(self) -> None:
        self._writer.submit(self._file.close, self.path)
        if self._own_writer:
            self._writer.close()


def _plain(value):
    """JSON for tensors and numpy scalars that slipped into a record."""
    return value.item() if hasattr(value, "item") else str(value)

