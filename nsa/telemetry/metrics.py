"""Metrics as CSV: a header row, then one flushed row per log step."""

from __future__ import annotations

import csv
from pathlib import Path


class MetricsCSV:
    def __init__(self, path: Path, fields: list[str]):
        self.fields = fields
        self._file = open(path, "w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=fields, extrasaction="raise")
        self._writer.writeheader()
        self._file.flush()

    def write(self, row: dict) -> None:
        self._writer.writerow({k: _fmt(row.get(k)) for k in self.fields})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
