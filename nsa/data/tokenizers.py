"""Tokenizers: each maps text to integer ids and has an end-of-text id placed between documents.

- byte: UTF-8 bytes plus end-of-text; needs nothing.
- gpt2: tiktoken with the GPT-2 ranks file, found offline (data.tokenizer_path, or the copy
  that ships in the `openai-whisper` sdist: pip install --no-deps openai-whisper==20250625).
- hf: a local Hugging Face `tokenizer.json` (data.tokenizer_path) through the `tokenizers` library.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ConfigError, UserError


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


def _gpt2_ranks_file(path: str) -> Path:
    if path:
        if not Path(path).is_file():
            raise UserError(f"data.tokenizer_path '{path}' is not a file; give the GPT-2 ranks file (gpt2.tiktoken)")
        return Path(path)
    spec = importlib.util.find_spec("whisper")  # locate, never import: whisper itself pulls in heavy deps
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "assets" / "gpt2.tiktoken"
        if candidate.is_file():
            return candidate
    raise UserError(
        "the gpt2 tokenizer needs its ranks file offline: pip install --no-deps openai-whisper==20250625 "
        "(it ships whisper/assets/gpt2.tiktoken) or set data.tokenizer_path=/path/to/gpt2.tiktoken"
    )


class GPT2Tokenizer:
    """The real GPT-2 BPE (identical to tiktoken's r50k_base) from a local ranks file."""

    name = "gpt2"

    def __init__(self, path: str = ""):
        try:
            import tiktoken
            import tiktoken.load
            from tiktoken_ext.openai_public import r50k_pat_str
        except ImportError:
            raise UserError("the gpt2 tokenizer needs tiktoken: pip install tiktoken") from None
        self.ranks_file = _gpt2_ranks_file(path)
        """The GPT-2 ranks file the vocabulary was read from."""
        ranks = tiktoken.load.load_tiktoken_bpe(str(self.ranks_file))
        self._enc = tiktoken.Encoding(
            name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
        )
        self.vocab_size = self._enc.n_vocab
        self.eot_id = 50256

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


class HFTokenizer:
    """A local Hugging Face tokenizer.json; its end-of-text token is the first of the usual names it has."""

    name = "hf"
    _EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")

    def __init__(self, path: str):
        if not path or not Path(path).is_file():
            raise UserError("data.tokenizer=hf needs data.tokenizer_path=/path/to/tokenizer.json (a local file)")
        try:
            from tokenizers import Tokenizer as HFTok
        except ImportError:
            raise UserError("the hf tokenizer needs the tokenizers package: pip install tokenizers") from None
        self.backend = HFTok.from_file(path)
        """The tokenizers-library tokenizer read from the file."""
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        eot = next((self.backend.token_to_id(t) for t in self._EOT_NAMES if self.backend.token_to_id(t) is not None), None)
        if eot is None:
            raise UserError(f"tokenizer '{path}' has no end-of-text token (looked for {', '.join(self._EOT_NAMES)})")
        self.eot_id = eot

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids])


def get_tokenizer(name: str, path: str = "") -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(path)
    if name == "hf":
        return HFTokenizer(path)
    raise ConfigError(f"data.tokenizer='{name}' is unknown; choose one of byte, gpt2, hf")


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round the embedding table up so matrix shapes stay friendly to the hardware."""
    return -(-vocab_size // multiple) * multiple
