"""Token shards: `nsa prepare` writes them once; training reads them by memmap.

A shard is a 32-byte header (magic, version, bytes per token, token count, end-of-text id,
vocabulary size) followed by the tokens as little-endian uint16 (vocabularies up to 65536)
or uint32. A folder holds train_*.bin and val_*.bin plus meta.json (tokenizer, source, counts).
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..storage import DamagedFile

MAGIC = b"NSATOKS1"
HEADER = struct.Struct("<8sIIQII")
VERSION = 1


def write_shard(path: Path, tokens: np.ndarray, eot_id: int, vocab_size: int) -> None:
    """Write atomically (temporary file, then rename)."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, np.dtype(dtype).itemsize, len(tokens), eot_id, vocab_size))
        f.write(np.asarray(tokens, dtype=dtype).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[np.ndarray, dict]:
    """(memory-mapped tokens, header fields) of one shard."""
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size or raw[:8] != MAGIC:
        raise UserError(f"'{path}' is not an nsa token shard (write shards with `nsa prepare`)")
    _, version, itemsize, n_tokens, eot_id, vocab_size = HEADER.unpack(raw)
    if version != VERSION or itemsize not in (2, 4):
        raise UserError(f"'{path}' has shard version {version} / {itemsize}-byte tokens; re-run `nsa prepare`")
    dtype = np.uint16 if itemsize == 2 else np.uint32
    held = (path.stat().st_size - HEADER.size) // itemsize
    if held < n_tokens:
        raise DamagedFile(f"shard '{path}' is damaged: it holds {held:,} tokens where its header records "
                          f"{n_tokens:,}; re-run `nsa prepare` to write the shards again")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(n_tokens,))
    return tokens, {"eot_id": eot_id, "vocab_size": vocab_size, "n_tokens": n_tokens}


class ShardWriter:
    """Accumulates documents (end-of-text after each) and writes shards of about `shard_tokens` tokens."""

    def __init__(self, folder: Path, split: str, eot_id: int, vocab_size: int, shard_tokens: int):
        self.folder, self.split = folder, split
        self.eot_id, self.vocab_size, self.shard_tokens = eot_id, vocab_size, shard_tokens
        self.parts: list[np.ndarray] = []
        self.pending = 0
        self.shards = 0
        self.tokens = 0
        self.documents = 0

    def add(self, tokens: np.ndarray) -> None:
        self.parts += [tokens, np.array([self.eot_id])]
        self.pending += len(tokens) + 1
        self.documents += 1
        if self.pending >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        tokens = np.concatenate(self.parts)
        write_shard(self.folder / f"{self.split}_{self.shards:05d}.bin", tokens, self.eot_id, self.vocab_size)
        self.shards += 1
        self.tokens += len(tokens)
        self.parts, self.pending = [], 0


class ShardWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a split's shards (none crosses a shard boundary)."""

    def __init__(self, folder: str, split: str, seq_len: int):
        files = sorted(Path(folder).glob(f"{split}_*.bin"))
        self.shards = [read_shard(f)[0] for f in files]
        self.seq_len = seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.ends = np.cumsum(counts).tolist()
        self.n_tokens = sum(len(s) for s in self.shards)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i in indices:
            shard = bisect.bisect_right(self.ends, i)
            local = i - (self.ends[shard - 1] if shard else 0)
            start = local * self.seq_len
            rows.append(torch.from_numpy(self.shards[shard][start : start + self.seq_len + 1].astype(np.int64)))
        stacked = torch.stack(rows)
        return stacked[:, :-1], stacked[:, 1:]


def load_meta(folder: str) -> dict:
    meta = Path(folder) / "meta.json"
    if not meta.is_file():
        raise UserError(f"'{folder}' has no meta.json: point data.path at a folder written by `nsa prepare`")
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedFile(f"'{meta}' is damaged ({e}); re-run `nsa prepare` to write the shards again") from None
    if not isinstance(data, dict) or "tokenizer" not in data:
        raise DamagedFile(f"'{meta}' does not describe token shards; re-run `nsa prepare` to write them again")
    return data


def write_meta(folder: Path, meta: dict) -> None:
    tmp = folder / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, folder / "meta.json")
