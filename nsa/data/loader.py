"""Batches for one rank: from windows (in memory or shards), from a document stream, synthetic tokens, or
synthetic retrieval examples.

Every batch stream is deterministic given (seed, rank, world size) and exposes the exact
position after the last batch it returned (`state_dict`), so a resumed run continues
with the very next batch. `Prefetcher` runs a stream on a background thread. A batch is
(inputs, targets), or with data.document_masking (inputs, targets, cu_seqlens): see `split_batch`.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import UserError
from .boundaries import boundaries_for
from .retrieval import MIXED_TASKS, RetrievalTasks, example_rng
from .config import DataConfig
from .packing import build_splits
from .shards import ShardWindows, load_meta
from .sources import open_stream
from .tokenizers import Tokenizer

Batch = tuple[torch.Tensor, ...]
"""(x, y): inputs and next-token targets [B, T] (int64; a target of -1 is ignored); with document masking,
(x, y, cu_seqlens): the document boundaries too (int32 [B * T + 1], nsa.data.boundaries)."""


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x, y, cu_seqlens) of a batch; cu_seqlens is None for a batch without document boundaries."""
    x, y, *boundaries = batch
    return x, y, boundaries[0] if boundaries else None


class BatchStream(Protocol):
    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Windows(Protocol):
    def __len__(self) -> int: ...

    def batch(self, indices: list[int]) -> Batch: ...


class WindowBatches:
    """Shuffled windows: each epoch a fresh seeded permutation; global batch i is entries
    [i * world * B, (i + 1) * world * B) of it and rank r takes its r-th slice of B."""

    def __init__(self, windows: Windows, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(windows) == 0:
            raise UserError("the training data holds no complete window of train.seq_len + 1 tokens")
        self.windows, self.batch_size, self.seed, self.rank, self.world = windows, batch_size, seed, rank, world
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.windows), generator=g).tolist()

    def _take(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), len(self._order) - self.cursor)
            out += self._order[self.cursor : self.cursor + take]
            self.cursor += take
        return out

    def next_batch(self) -> Batch:
        global_batch = self._take(self.world * self.batch_size)
        return self.windows.batch(global_batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
        if self.cursor > len(self._order):  # saved at another sequence length (a curriculum): its epoch is over
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)


class StreamBatches:
    """Documents streamed through `datasets` (sharded over ranks), packed into windows of seq_len + 1.

    Every round(1/val_fraction)-th document of a rank's shard is validation, the rest training.
    State: the dataset's own position, the document counter and the tokens not yet emitted.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, batch_size: int, rank: int, world: int,
                 split: str):
        self.cfg, self.tokenizer, self.seq_len, self.batch_size = cfg, tokenizer, seq_len, batch_size
        self.rank, self.world, self.split = rank, world, split
        self.stride = max(2, round(1 / cfg.val_fraction)) if cfg.val_fraction > 0 else 0
        self.dataset = open_stream(cfg.source, cfg.path, cfg.hf_name, cfg.hf_config, cfg.hf_split)
        if world > 1:
            from datasets.distributed import split_dataset_by_node

            self.dataset = split_dataset_by_node(self.dataset, rank=rank, world_size=world)
        self.doc_index = 0
        self.buffer: list[int] = []
        self._it = None

    def _wanted(self, doc_index: int) -> bool:
        is_val = self.stride > 0 and doc_index % self.stride == self.stride - 1
        return is_val == (self.split == "val")

    def _next_window(self) -> list[int]:
        if self._it is None:
            self._it = iter(self.dataset)
        while len(self.buffer) < self.seq_len + 1:
            try:
                record = next(self._it)
            except StopIteration:
                self._it = iter(self.dataset)  # next epoch of the stream
                if not self.buffer and self.doc_index == 0:
                    raise UserError(f"data source '{self.cfg.hf_name or self.cfg.path}' is empty") from None
                continue
            index, self.doc_index = self.doc_index, self.doc_index + 1
            if not self._wanted(index):
                continue
            if self.cfg.text_field not in record:
                raise UserError(
                    f"data.text_field='{self.cfg.text_field}' is not a field of the records "
                    f"(fields: {', '.join(sorted(record))}); set data.text_field"
                )
            self.buffer += self.tokenizer.encode(record[self.cfg.text_field]).tolist() + [self.tokenizer.eot_id]
        window, self.buffer = self.buffer[: self.seq_len + 1], self.buffer[self.seq_len :]
        return window

    def next_batch(self) -> Batch:
        rows = torch.tensor([self._next_window() for _ in range(self.batch_size)], dtype=torch.int64)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"dataset": copy.deepcopy(self.dataset.state_dict()), "doc_index": self.doc_index,
                "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self.doc_index, self.buffer, self._it = int(state["doc_index"]), list(state["buffer"]), None


class SyntheticBatches:
    """Uniformly random tokens (for benchmarks); batch i of rank r depends only on (seed, r, i)."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int, rank: int = 0):
        self.vocab_size, self.seq_len, self.batch_size, self.seed, self.rank = vocab_size, seq_len, batch_size, seed, rank
        self.counter = 0

    def next_batch(self) -> Batch:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_033 + self.counter)
        self.counter += 1
        rows = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"counter": self.counter}

    def load_state_dict(self, state: dict) -> None:
        self.counter = int(state["counter"])


class RetrievalBatches:
    """Retrieval examples (nsa/data/retrieval.py), one per sequence of seq_len + 1 tokens, each with its needle at
    a uniformly random depth (or, for a depth_ends share of them, at depth 0 or 1); batch i of rank r depends only
    on (seed, r, i). With mix_lengths, batch i is of a length drawn from (seq_len, *mix_lengths) by (seed, i) alone,
    so that every rank draws the same, with as many rows as keep batch_size * seq_len tokens."""

    def __init__(self, tasks: RetrievalTasks, task: str, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 answer_only: bool = False, tail: int = 0, depth_ends: float = 0.0, mix_lengths: Sequence[int] = ()):
        self.tasks, self.task, self.seq_len, self.batch_size, self.seed, self.rank = (
            tasks, task, seq_len, batch_size, seed, rank)
        self.answer_only, self.tail, self.depth_ends = answer_only, tail, depth_ends
        self.lengths = (seq_len, *mix_lengths)
        self.counter = 0
        tokens = seq_len * batch_size
        for length in mix_lengths:
            if length < 1 or tokens % length:
                raise UserError(f"data.retrieval.mix_lengths holds {length}, which does not divide the "
                                f"{tokens:,} tokens of a step (train.batch_size x train.seq_len); use lengths that do")
        if tail < 0:
            raise UserError(f"data.retrieval.tail must be >= 0, got {tail}")
        if not 0.0 <= depth_ends <= 1.0:
            raise UserError(f"data.retrieval.depth_ends is a share of the examples: set it in [0, 1], got {depth_ends}")
        for name in MIXED_TASKS if task == "mixed" else (task,):
            try:  # here, at setup, rather than on the prefetch thread
                tasks.example(name, min(self.lengths) + 1 - tail, 0.5, example_rng(seed))
            except ValueError as e:
                shortest = min(self.lengths)
                what = (f"train.seq_len={seq_len}" if shortest == seq_len else
                        f"data.retrieval.mix_lengths' {shortest}") + (f" less data.retrieval.tail={tail}" if tail else "")
                raise UserError(f"{what} is too short for data.retrieval.task={task}: {e}") from None

    def _length(self) -> int:
        if len(self.lengths) == 1:  # no draw: the stream stays as it was without mix_lengths
            return self.seq_len
        return self.lengths[int(example_rng(self.seed, self.counter).integers(len(self.lengths)))]

    def next_batch(self) -> Batch:
        rows, starts, ends = [], [], []
        length = self._length()
        for row in range(self.seq_len * self.batch_size // length):
            rng = example_rng(self.seed, self.rank, self.counter, row)
            task = MIXED_TASKS[int(rng.integers(len(MIXED_TASKS)))] if self.task == "mixed" else self.task
            tail = int(rng.integers(self.tail + 1)) if self.tail else 0  # no draw at 0: the stream stays as it was
            example = self.tasks.example(task, length + 1 - tail, self._depth(rng), rng)
            rows.append(np.concatenate([example.tokens, self.tasks.filler(tail, rng)]))
            starts.append(example.answer_start)
            ends.append(example.answer_start + example.answer_len)
        self.counter += 1
        tokens = torch.from_numpy(np.stack(rows))
        x, y = tokens[:, :-1], tokens[:, 1:].clone()
        if self.answer_only:  # target j is token j + 1: the answer's targets are j in [start - 1, end - 1)
            j = torch.arange(length)[None, :]
            y[(j < torch.tensor(starts)[:, None] - 1) | (j >= torch.tensor(ends)[:, None] - 1)] = -1
        return x, y

    def _depth(self, rng: np.random.Generator) -> float:
        depth = float(rng.random())
        if self.depth_ends and rng.random() < self.depth_ends:  # no draw at 0: the stream stays as it was
            depth = float(depth < 0.5)
        return depth

    def state_dict(self) -> dict:
        return {"counter": self.counter}

    def load_state_dict(self, state: dict) -> None:
        self.counter = int(state["counter"])


class WithBoundaries:
    """A stream whose batches gain their document boundaries (computed on the producer thread); the position is
    the wrapped stream's, so resuming stays exact."""

    def __init__(self, stream: BatchStream, boundaries: Callable[[torch.Tensor], torch.Tensor]):
        self.stream, self.boundaries = stream, boundaries

    def next_batch(self) -> Batch:
        x, y = self.stream.next_batch()
        return x, y, self.boundaries(x)

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


CLOSE_TIMEOUT_S = 10.0
"""How long Prefetcher.close waits for the batch being produced (a stream stuck on the network is left behind)."""


class Prefetcher:
    """Produces batches of a stream on a background thread; `state_dict` is the position after the
    last batch handed out (not the last one prepared), so checkpoints stay exact."""

    _END = object()

    def __init__(self, stream: BatchStream, depth: int, first_batch_timeout_s: float, source: str):
        self.stream, self.depth, self.timeout, self.source = stream, depth, first_batch_timeout_s, source
        self._state = stream.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._delivered = 0
        self._pin_device: torch.device | None = None

    def pin_for(self, device: torch.device) -> None:
        """Hand out contiguous batches in pinned memory (made on the producer thread) when `device` is a GPU.

        A batch in pageable memory costs the training thread a CPU copy and a wait for the GPU on every step,
        with the GPU idle meanwhile; from pinned memory the copy is queued behind the GPU's work.
        """
        if self._delivered or self._thread is not None:
            raise RuntimeError("choose pinning before the first batch")
        self._pin_device = device if device.type == "cuda" else None

    def _prepare(self, batch: Batch) -> Batch:
        if self._pin_device is None:
            return tuple(t.contiguous() for t in batch)
        return tuple(t.contiguous().pin_memory() for t in batch)

    def _produce(self) -> None:
        try:
            if self._pin_device is not None:  # pinned memory belongs to the current device's context
                torch.cuda.set_device(self._pin_device)
            while not self._stop.is_set():
                item = (self._prepare(self.stream.next_batch()), self.stream.state_dict())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the training thread, which raises it
            self._queue.put(e)

    def next_batch(self) -> Batch:
        if self.depth <= 0:  # no thread: produce inline
            batch = self._prepare(self.stream.next_batch())
            self._state = self.stream.state_dict()
            self._delivered += 1
            return batch
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="nsa-data", daemon=True)
            self._thread.start()
        timeout = self.timeout if self._delivered == 0 else None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            self.close(wait=False)  # the producer is stuck in the source: waiting for it would only delay this error
            raise UserError(
                f"no training batch from data source '{self.source}' after {self.timeout:.0f}s "
                "(data.first_batch_timeout_s); check the path or network, or prepare shards with `nsa prepare`"
            ) from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self._state = item
        self._delivered += 1
        return batch

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load the data state before the first batch")
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()

    def close(self, wait: bool = True) -> None:
        """Stop the producer and (wait=True) let it finish the batch in hand: a daemon thread still inside torch
        when the interpreter exits aborts the process ('terminate called without an active exception', exit
        134) after a run that finished."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=CLOSE_TIMEOUT_S)


@dataclass
class Data:
    """A rank's training batches and its fixed validation batches."""

    train: Prefetcher
    val: list[Batch]
    description: str


def _window_val_batches(windows: Windows | None, batch_size: int, n_batches: int, rank: int, world: int):
    """The first n_batches * world * B validation windows, in order; rank r takes its slices."""
    if windows is None or len(windows) == 0:
        return []
    out = []
    for b in range(n_batches):
        start = (b * world + rank) * batch_size
        indices = [i % len(windows) for i in range(start, start + batch_size)]
        out.append(windows.batch(indices))
    return out


def build_data(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, batch_size: int, eval_batches: int, seed: int,
               rank: int = 0, world: int = 1) -> Data:
    """A rank's training stream (not started) and validation batches; with document masking
    (DataConfig.masks_documents) every batch carries its document boundaries."""
    stream, val, name, description = _source_batches(cfg, tokenizer, seq_len, batch_size, eval_batches, seed, rank,
                                                     world)
    if cfg.masks_documents():
        boundaries = boundaries_for(cfg.source, tokenizer.eot_id)
        stream = WithBoundaries(stream, boundaries)
        val = [(x, y, boundaries(x)) for x, y in val]
        description += "; attention masked per document"
    return Data(Prefetcher(stream, cfg.prefetch, cfg.first_batch_timeout_s, name), val, description)


def _source_batches(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, batch_size: int, eval_batches: int,
                    seed: int, rank: int, world: int) -> tuple[BatchStream, list[Batch], str, str]:
    """(training stream, validation batches, source name for messages, description) of data.source."""
    if cfg.source == "synthetic":
        stream = SyntheticBatches(tokenizer.vocab_size, seq_len, batch_size, seed, rank)
        val_stream = SyntheticBatches(tokenizer.vocab_size, seq_len, batch_size, seed + 1_000_003, rank)
        val = [val_stream.next_batch() for _ in range(eval_batches)] if cfg.val_fraction > 0 else []
        return stream, val, "synthetic", f"synthetic tokens (vocab {tokenizer.vocab_size})"
    if cfg.source == "retrieval":
        tasks = RetrievalTasks(tokenizer, cfg.retrieval.kv_pairs)
        answer_only = cfg.retrieval.loss == "answer"
        shape = dict(answer_only=answer_only, tail=cfg.retrieval.tail, depth_ends=cfg.retrieval.depth_ends)
        stream = RetrievalBatches(tasks, cfg.retrieval.task, seq_len, batch_size, seed, rank, **shape,
                                  mix_lengths=cfg.retrieval.mix_lengths)
        # Validation examples come from another seed, so they never repeat a training example.
        val_stream = RetrievalBatches(tasks, cfg.retrieval.task, seq_len, batch_size, seed + 1_000_003, rank, **shape)
        val = [val_stream.next_batch() for _ in range(eval_batches)] if cfg.val_fraction > 0 else []
        return stream, val, "retrieval", (f"synthetic {cfg.retrieval.task} retrieval examples ({tokenizer.name} "
                                          f"tokens; loss on {'the answer' if answer_only else 'every token'})")
    if cfg.source in ("jsonl", "parquet", "hf"):
        stream = StreamBatches(cfg, tokenizer, seq_len, batch_size, rank, world, "train")
        val = []
        if cfg.val_fraction > 0:
            val_stream = StreamBatches(cfg, tokenizer, seq_len, batch_size, rank, world, "val")
            val = [val_stream.next_batch() for _ in range(eval_batches)]
        name = cfg.hf_name or cfg.path
        return stream, val, name, f"{cfg.source} stream '{name}' ({tokenizer.name} tokens)"
    if cfg.source == "shards":
        meta = load_meta(cfg.path)
        if meta["tokenizer"] != tokenizer.name:
            raise UserError(
                f"shards in '{cfg.path}' were made with the '{meta['tokenizer']}' tokenizer; "
                f"set data.tokenizer={meta['tokenizer']}"
            )
        train_windows = ShardWindows(cfg.path, "train", seq_len)
        val_windows = ShardWindows(cfg.path, "val", seq_len)
        description = f"shards '{cfg.path}': {train_windows.n_tokens:,} train / {val_windows.n_tokens:,} val tokens"
    else:
        train_windows, val_windows = build_splits(cfg, tokenizer, seq_len)
        n_val = len(val_windows.tokens) if val_windows else 0
        description = f"{cfg.source} ({tokenizer.name} tokens): {len(train_windows.tokens):,} train / {n_val:,} val tokens"
    stream = WindowBatches(train_windows, batch_size, seed, rank, world)
    val = _window_val_batches(val_windows, batch_size, eval_batches, rank, world)
    return stream, val, cfg.path or cfg.source, description
