"""Metrics as CSV: a header row, then one flushed row per log step."""

from __future__ import annotations

import csv
import os
from pathlib import Path


class MetricsCSV:
    """metrics.csv, started with `rows` (those kept from before a resume): they are written to a new file that
    then replaces the old one, so a failed rewrite (e.g. a full disk) loses nothing."""

    def __init__(self, path: Path, fields: list[str], rows: list[dict] = ()):
        self.fields = fields
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
        self._file = open(path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=fields, extrasaction="raise")

    def write(self, row: dict) -> None:
        self._writer.writerow({k: _csv_cell(row.get(k)) for k in self.fields})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _csv_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
