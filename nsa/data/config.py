"""Data configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RetrievalConfig:
    """The synthetic retrieval task of data.source='retrieval' (nsa/data/retrieval.py): every training sequence
    is one fresh example of train.seq_len tokens, its needle at a uniformly random depth (see depth_ends)."""

    task: Literal["passkey", "kv", "multikey", "mixed"] = "passkey"
    """'passkey': a 5-digit pass key hidden in filler, asked for at the end; 'kv': many 'The value of key K is
    V.' pairs in filler, one key asked for; 'multikey': several labelled pass keys ('The red pass key is N.'),
    one label asked for; 'mixed': each sequence picks passkey or kv at random."""
    kv_pairs: int = 8
    """Key-value pairs per kv example, or labelled pass keys per multikey example (at most 16), the queried one
    and distractors; fewer where they would fill more than half of the sequence. `nsa eval` uses the same
    number."""
    loss: Literal["all", "answer"] = "all"
    """'all': the next-token loss on every token, as for text; 'answer': on the answer's tokens only (the other
    targets are -1, which the loss ignores). At 16k tokens the ~6 answer tokens are otherwise a 1/2700 share of
    the loss, their gradient drowned by the filler's residual ones; the validation loss then reads as nats per
    answer token."""
    tail: int = 0
    """Up to this many filler tokens after the answer (a uniform number per example), so that the question does not
    always end where the sequence does. NSA's compression and selection blocks are fixed to positions: trained
    with 0 at one length, a model sees its question at one place of that grid in every example and may depend
    on it, failing when the question moves by a token. A selection block's length (model.nsa.sel_block) covers
    every offset. The loss ignores the tail under loss='answer'."""
    depth_ends: float = 0.0
    """Share of training examples whose needle goes to depth 0 or 1 exactly (half each; the rest uniform).
    A uniform depth almost never puts the needle right before the question at long lengths, and models trained
    so fail that case (NSA and dense alike) while passing every other depth. `nsa eval` always scores depths 0
    and 1."""
    mix_lengths: list[int] = field(default_factory=list)
    """More example lengths trained alongside train.seq_len, e.g. [32768, 65536]: each step draws one of
    train.seq_len and these (uniformly, the same on every rank) and holds batch_size * seq_len / length examples
    of it, so every step has the same tokens. Each must divide batch_size * seq_len. Validation stays at
    train.seq_len. With one length at a time a model settles on the shorter length first and may lose the
    task at the step to the next; drawing the lengths per step keeps every one of them in training."""


@dataclass
class DataConfig:
    """Where training text comes from, how it becomes tokens, and how batches are fed."""

    source: Literal["embedded", "text", "jsonl", "parquet", "hf", "shards", "synthetic", "retrieval"] = "embedded"
    """'embedded': the King James Bible shipped as a pip dependency; 'text': local .txt files; 'jsonl' /
    'parquet': local files streamed through `datasets`; 'hf': a Hugging Face dataset streamed from the hub;
    'shards': token shards written by `nsa prepare` (the fast default for long runs); 'synthetic': random
    tokens (benchmarks); 'retrieval': synthetic passkey / key-value retrieval examples (data.retrieval)."""
    path: str = ""
    """File, folder or glob for text/jsonl/parquet sources; the `nsa prepare` output folder for shards."""
    text_field: str = "text"
    """Record field holding the document text (jsonl, parquet, hf)."""
    hf_name: str = ""
    """Hugging Face dataset name for source='hf', e.g. HuggingFaceFW/fineweb-edu."""
    hf_config: str = ""
    """Hugging Face dataset configuration, e.g. sample-10BT."""
    hf_split: str = "train"
    """Hugging Face split to stream."""
    tokenizer: Literal["byte", "gpt2", "hf"] = "byte"
    """'byte' (UTF-8 bytes + end-of-text), 'gpt2' (tiktoken, offline ranks file) or 'hf' (a local tokenizer.json)."""
    tokenizer_path: str = ""
    """The GPT-2 ranks file (optional; found in the openai-whisper package otherwise) or the tokenizer.json for 'hf'."""
    val_fraction: float = 0.05
    """Share held out for validation: every round(1/val_fraction)-th document (with fewer documents than that,
    the stream's tail for small local text sources, the last document for `nsa prepare`)."""
    prefetch: int = 2
    """Batches prepared ahead on a background thread."""
    first_batch_timeout_s: float = 300.0
    """Fail with a clear message if the first batch takes longer than this (e.g. an unreachable dataset)."""
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    """The task of data.source='retrieval'."""
    document_masking: bool | Literal["auto"] = "auto"
    """Attend within each document only: every batch carries its document boundaries (a document starts at each
    sequence start and after each end-of-text token; for 'retrieval', each example is one), and each document is
    its own sequence, its positions starting at 0. 'auto': on for every source but 'synthetic', whose random
    tokens are no documents. false: documents packed into a sequence attend to each other across the
    end-of-text token, with positions running over the whole sequence. Fixed on resume (docs/data.md)."""

    def masks_documents(self) -> bool:
        """Whether batches carry document boundaries (document_masking with 'auto' decided for the source)."""
        if self.document_masking == "auto":
            return self.source != "synthetic"
        return self.document_masking
