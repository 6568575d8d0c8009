"""`nsa prepare`: tokenize a document source once into token shards (read later by memmap)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from ..errors import UserError
from .config import DataConfig
from .shards import ShardWriter, write_meta
from .sources import embedded_corpus, open_stream, text_files
from .tokenizers import get_tokenizer


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    if cfg.source == "embedded":
        yield from embedded_corpus()
    elif cfg.source == "text":
        yield from text_files(cfg.path)
    elif cfg.source in ("jsonl", "parquet", "hf"):
        for record in open_stream(cfg.source, cfg.path, cfg.hf_name, cfg.hf_config, cfg.hf_split):
            if cfg.text_field not in record:
                raise UserError(f"data.text_field='{cfg.text_field}' is not a field of the records "
                                f"(fields: {', '.join(sorted(record))})")
            yield record[cfg.text_field]
    else:
        raise UserError(f"nsa prepare reads documents: data.source='{cfg.source}' has none "
                        "(use embedded, text, jsonl, parquet or hf)")


def prepare(cfg: DataConfig, out: str, shard_tokens: int = 100_000_000, max_documents: int = 0,
            progress: bool = True) -> dict:
    """Write train_*.bin / val_*.bin shards and meta.json into `out`; returns the metadata."""
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise UserError(f"output folder '{out}' is not empty; choose a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = get_tokenizer(cfg.tokenizer, cfg.tokenizer_path)
    stride = max(2, round(1 / cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    writers = {split: ShardWriter(folder, split, tokenizer.eot_id, tokenizer.vocab_size, shard_tokens)
               for split in ("train", "val")}
    start = time.time()
    bar = tqdm(desc="prepare", unit=" docs", disable=not progress)
    # The latest training document is written one document late: where the stride held out none (fewer than
    # `stride` documents), the last document goes to validation instead.
    held = None
    for i, doc in enumerate(iter_documents(cfg)):
        if max_documents and i >= max_documents:
            break
        tokens = tokenizer.encode(doc)
        if stride and i % stride == stride - 1:
            writers["val"].add(tokens)
        else:
            if held is not None:
                writers["train"].add(held)
            held = tokens
        bar.update(1)
        if i % 1000 == 0:
            bar.set_postfix(tokens=f"{sum(w.tokens + w.pending for w in writers.values()):,}")
    bar.close()
    if held is not None:
        short_of_val = stride and writers["val"].documents == 0 and writers["train"].documents > 0
        writers["val" if short_of_val else "train"].add(held)
    for w in writers.values():
        w.flush()
    if writers["train"].tokens == 0:
        raise UserError("the source produced no training documents")
    meta = {
        "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
        "source": {"source": cfg.source, "path": cfg.path, "hf_name": cfg.hf_name, "hf_config": cfg.hf_config,
                   "hf_split": cfg.hf_split, "text_field": cfg.text_field, "val_fraction": cfg.val_fraction},
        "splits": {s: {"documents": w.documents, "tokens": w.tokens, "shards": w.shards} for s, w in writers.items()},
        "seconds": round(time.time() - start, 1),
    }
    write_meta(folder, meta)
    return meta
