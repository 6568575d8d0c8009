"""Synthetic long-context retrieval examples: a passkey, one key of many key-value pairs, or one of several
labelled pass keys, hidden in filler.

An example is exactly `length` tokens of the given tokenizer and ends with its answer:

    filler ... [needle at the requested depth] ... filler  question  answer

- passkey: the needle is " The pass key is NNNNN. Remember it."; the question " What is the pass key?
  The pass key is" and the answer " NNNNN".
- kv (multi-key associative recall): several " The value of key KKKKK is VVVVV." pairs, the queried one at
  the requested depth and the others (distractors) at random places; the question asks for the queried key.
- multikey (several needles): labelled pass keys " The LABEL pass key is NNNNN. Remember it.", the queried one
  at the requested depth and the others (distractors, other labels and keys) at random places; the question
  " What is the LABEL pass key? The LABEL pass key is" and the answer " NNNNN". Like passkey, the needle's
  words occur nowhere in the filler; unlike it, every distractor has them too, so the label decides.

Depth is the needle's start over the haystack (everything before the question) less the needle:
0 puts it first, 1 right before the question. Needles go between filler sentences, so the achieved depth
is within one sentence of the request (`RetrievalExample.depth` holds it).

Every piece of text starts with a space and is tokenized on its own, then the token arrays are joined:
for the BPE tokenizers (gpt2, hf) the pre-tokenizer splits before a space anyway, so the pieces tokenize
as they would in one string, and the length can be hit exactly by trimming filler tokens.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

from .tokenizers import Tokenizer

TASKS = ("passkey", "kv", "multikey")
MIXED_TASKS = ("passkey", "kv")
"""The tasks data.retrieval.task='mixed' draws from (the two it has always drawn from: a mixed stream stays
the same when tasks are added)."""


class ExampleTooShort(ValueError):
    """An example of a task cannot fit the length asked for; `needed` is the length it would take."""

    def __init__(self, task: str, needed: int, length: int):
        super().__init__(f"a {task} example needs at least {needed} tokens, got length {length}")
        self.needed = needed

# The classic passkey haystack (Mohtashami & Jaggi 2023; also the NSA paper's needle test). We use it rather
# than corpus text because a fixed cycle of sentences is learned within a few steps: a model trained on the
# retrieval source then spends its capacity, and the loss its signal, on the needle and the answer, the only
# tokens the local context cannot predict. Corpus text would bury the few answer tokens of a 16k sequence under
# language-modelling loss that a ten-minute run cannot reduce much.
FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again.")
PASSKEY_DIGITS = 5
KV_CHARS = 5
KV_ALPHABET = string.ascii_lowercase + string.digits
KV_MAX_SHARE = 0.5
"""The key-value pairs of a kv example (or the needles of a multikey one) take at most this share of its
tokens; the rest is filler."""
LABELS = ("red", "orange", "purple", "black", "white", "silver", "golden", "brown", "pink", "grey", "violet",
          "crimson", "amber", "ivory", "scarlet", "teal")
"""The labels of multikey's pass keys: words the filler never uses (it has green, blue and yellow)."""


@dataclass(frozen=True)
class RetrievalExample:
    """One example: `tokens` ends with the answer, which starts at `answer_start`."""

    task: str
    tokens: np.ndarray
    """int64 [length]."""
    answer_start: int
    needle_start: int
    """First token of the needle that holds the answer (the queried pair for kv)."""
    needle_len: int
    depth: float
    """Achieved depth: needle_start / (haystack tokens - needle_len), in [0, 1]."""
    answer: str
    question_start: int
    """First token of the question (it runs up to answer_start)."""
    distractors: int = 0
    """Key-value pairs (kv) or pass keys (multikey) besides the queried one."""
    key_offset: int = 0
    """Answer tokens before the first that holds a character of the key: 1 where the answer's leading space is
    a token of its own (bytes), 0 where the tokenizer merges it into the key's first token (GPT-2). The token
    after the leading space is the first one a model must retrieve; the space itself is given by the prompt."""

    @property
    def answer_len(self) -> int:
        return len(self.tokens) - self.answer_start


class RetrievalTasks:
    """Builds examples for one tokenizer (the filler is tokenized once)."""

    def __init__(self, tokenizer: Tokenizer, kv_pairs: int = 8):
        if kv_pairs < 1:
            raise ValueError(f"kv_pairs must be >= 1, got {kv_pairs}")
        self.tokenizer, self.kv_pairs = tokenizer, kv_pairs
        self._space = self._encode(" ")  # what an answer's leading space encodes to alone (key_offset)
        sentences = [self._encode(s) for s in FILLER]
        self._cycle = np.concatenate(sentences)
        self._cycle_starts = np.cumsum([0] + [len(s) for s in sentences[:-1]])

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def example(self, task: str, length: int, depth: float, rng: np.random.Generator) -> RetrievalExample:
        """An example of exactly `length` tokens; raises ExampleTooShort when `length` is too short for `task`."""
        if task not in TASKS:
            raise ValueError(f"unknown retrieval task '{task}'; choose from {', '.join(TASKS)}")
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        if task == "passkey":
            key = _pass_key(rng)
            needle = self._encode(f" The pass key is {key}. Remember it.")
            question = self._encode(" What is the pass key? The pass key is")
            return self._assemble(task, length, depth, rng, needle, [], question, key)
        if task == "multikey":
            labels = [LABELS[i] for i in rng.permutation(len(LABELS))[:min(self.kv_pairs, len(LABELS))]]
            values = [_pass_key(rng) for _ in labels]
            needles = [self._encode(f" The {label} pass key is {v}. Remember it.") for label, v in zip(labels, values)]
            question = self._encode(f" What is the {labels[0]} pass key? The {labels[0]} pass key is")
        else:
            keys = self._distinct_strings(rng, self.kv_pairs)
            values = [_random_string(rng) for _ in keys]
            needles = [self._encode(f" The value of key {k} is {v}.") for k, v in zip(keys, values)]
            question = self._encode(f" What is the value of key {keys[0]}? The value of key {keys[0]} is")
        answer_len = len(self._encode(" " + values[0]))
        # Distractors fill at most KV_MAX_SHARE of the example, so short contexts keep some haystack.
        budget = KV_MAX_SHARE * length - len(needles[0]) - len(question) - answer_len
        distractors = []
        for needle in needles[1:]:
            if len(needle) > budget:
                break
            distractors.append(needle)
            budget -= len(needle)
        return self._assemble(task, length, depth, rng, needles[0], distractors, question, values[0])

    def _distinct_strings(self, rng: np.random.Generator, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            s = _random_string(rng)
            if s not in out:
                out.append(s)
        return out

    def _assemble(self, task: str, length: int, depth: float, rng: np.random.Generator, needle: np.ndarray,
                  distractors: list[np.ndarray], question: np.ndarray, answer_text: str) -> RetrievalExample:
        answer = self._encode(" " + answer_text)
        space = self._space
        key_offset = len(space) if np.array_equal(answer[:len(space)], space) else 0
        n_filler = length - len(needle) - sum(len(d) for d in distractors) - len(question) - len(answer)
        if n_filler < 0:
            raise ExampleTooShort(task, length - n_filler, length)
        filler, boundaries = self._filler(n_filler, rng)
        # Distractors go to random sentence boundaries; the needle then to the gap nearest the requested depth.
        spots = np.sort(rng.choice(boundaries, size=len(distractors))) if distractors else np.zeros(0, np.int64)
        pieces: list[np.ndarray] = []
        gaps: list[tuple[int, int]] = []  # (haystack position, index in `pieces` where the needle would go)
        position, previous, d = 0, 0, 0
        for b in boundaries:
            pieces.append(filler[previous:b])
            position += b - previous
            previous = b
            gaps.append((position, len(pieces)))
            while d < len(distractors) and spots[d] == b:
                pieces.append(distractors[d])
                position += len(distractors[d])
                gaps.append((position, len(pieces)))
                d += 1
        haystack = position  # filler plus distractors
        target = depth * haystack
        needle_start, at = min(gaps, key=lambda g: abs(g[0] - target))
        pieces.insert(at, needle)
        tokens = np.concatenate(pieces + [question, answer])
        assert len(tokens) == length  # the filler length was computed to make it so
        return RetrievalExample(
            task=task, tokens=tokens, answer_start=length - len(answer), needle_start=needle_start,
            needle_len=len(needle), depth=needle_start / haystack if haystack else 0.0, answer=answer_text,
            question_start=length - len(answer) - len(question), distractors=len(distractors),
            key_offset=key_offset,
        )

    def filler(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n filler tokens, starting at a random sentence of the cycle (e.g. to follow an answer)."""
        start = int(self._cycle_starts[rng.integers(len(self._cycle_starts))])
        return np.tile(self._cycle, n // len(self._cycle) + 2)[start:start + n]

    def _filler(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
        """n filler tokens that end at a sentence boundary (a random one of the cycle) and start mid-cycle,
        and the sentence boundaries within them (0 and n included)."""
        cycle, starts = self._cycle, self._cycle_starts
        reps = n // len(cycle) + 2
        end = (reps - 1) * len(cycle) + int(starts[rng.integers(len(starts))])  # a sentence start in the last cycle
        begin = end - n
        stream = np.tile(cycle, reps)
        all_starts = (np.arange(reps)[:, None] * len(cycle) + starts[None, :]).ravel()
        inside = all_starts[(all_starts > begin) & (all_starts < end)] - begin
        return stream[begin:end], [0, *inside.tolist(), n] if n > 0 else [0]


def _pass_key(rng: np.random.Generator) -> str:
    """PASSKEY_DIGITS random digits, the first not 0."""
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, PASSKEY_DIGITS - 1))


def _random_string(rng: np.random.Generator) -> str:
    return "".join(KV_ALPHABET[i] for i in rng.integers(0, len(KV_ALPHABET), KV_CHARS))


def example_rng(seed: int, *parts: int) -> np.random.Generator:
    """A generator for one example, determined by a seed and integer coordinates (e.g. batch, row)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, *(p & 0xFFFFFFFF for p in parts)])
