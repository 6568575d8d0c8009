"""Data configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    """Where training text comes from and how it becomes tokens."""

    source: Literal["embedded", "text"] = "embedded"
    """'embedded': the King James Bible shipped as a pip dependency; 'text': local .txt files (data.path)."""
    path: str = ""
    """A .txt file or a folder searched recursively for .txt files (source='text')."""
    tokenizer: Literal["byte"] = "byte"
    """Tokenizer: 'byte' (UTF-8 bytes plus an end-of-text token)."""
    val_fraction: float = 0.05
    """Share held out for validation: every round(1/val_fraction)-th document, or the stream's tail when there are too few documents."""
