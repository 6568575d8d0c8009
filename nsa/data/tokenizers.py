"""Tokenizers: each maps text to integer ids and has an end-of-text id placed between documents."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..errors import ConfigError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus end-of-text 256: no vocabulary file, nothing to download."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    if name not in TOKENIZERS:
        raise ConfigError(f"data.tokenizer='{name}' is unknown; choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round the embedding table up so matrix shapes stay friendly to the hardware."""
    return -(-vocab_size // multiple) * multiple
