"""Documents -> one token stream (end-of-text between documents) -> fixed windows of seq_len + 1."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..errors import UserError
from .config import DataConfig
from .sources import embedded_corpus, text_files
from .tokenizers import Tokenizer


def pack(documents: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate tokenized documents, each followed by end-of-text."""
    parts = []
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    for doc in documents:
        parts.extend((tokenizer.encode(doc), eot))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def split_documents(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Every round(1/val_fraction)-th document goes to validation (spread across the corpus)."""
    if val_fraction <= 0:
        return documents, []
    stride = max(2, round(1 / val_fraction))
    train = [d for i, d in enumerate(documents) if i % stride != stride - 1]
    val = [d for i, d in enumerate(documents) if i % stride == stride - 1]
    return train, val


class TokenWindows:
    """Non-overlapping windows over a token stream; window i is tokens[i*T : i*T + T + 1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each [len(indices), seq_len]."""
        rows = torch.stack([self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in indices])
        return rows[:, :-1], rows[:, 1:]


def load_documents(cfg: DataConfig) -> list[str]:
    """All documents of a small local source (embedded corpus or .txt files)."""
    docs = list(embedded_corpus() if cfg.source == "embedded" else text_files(cfg.path))
    if not docs:
        raise UserError(f"data source '{cfg.source}' produced no documents")
    return docs


def build_splits(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> tuple[TokenWindows, TokenWindows | None]:
    """Train and validation windows. With too few documents to hold one out, the stream's tail is used."""
    docs = load_documents(cfg)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    if cfg.val_fraction > 0 and not val_docs:
        stream = pack(docs, tokenizer)
        cut = int(len(stream) * (1 - cfg.val_fraction))
        train_tokens, val_tokens = stream[:cut], stream[cut:]
    else:
        train_tokens, val_tokens = pack(train_docs, tokenizer), pack(val_docs, tokenizer)
    train = TokenWindows(train_tokens, seq_len)
    if len(train) == 0:
        raise UserError(
            f"the training split has {len(train_tokens)} tokens, fewer than one window of "
            f"train.seq_len+1={seq_len + 1}; use more text or a shorter train.seq_len"
        )
    if cfg.val_fraction <= 0:
        return train, None
    val = TokenWindows(val_tokens, seq_len)
    if len(val) == 0:
        raise UserError(
            f"the validation split has {len(val_tokens)} tokens, fewer than one window of {seq_len + 1}; "
            f"raise data.val_fraction, use more text, or set data.val_fraction=0"
        )
    return train, val
