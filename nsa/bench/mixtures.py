"""Document mixtures for `nsa bench attention --docs`: a spec such as `64k:1k-32k`, the lengths it stands for, and
the forms packed attention reads them in (cu_seqlens, FlexAttention's document block mask, jagged tensors).

A spec is `TOTAL:LENGTH` or `TOTAL:MIN-MAX`, optionally followed by `@SEED`; each size is a whole number of tokens,
with `k` for 1024 (`64k` = 65536):

- `64k:2k`: documents of 2k tokens each, 32 of them;
- `64k:1k-32k`: lengths drawn between 1k and 32k, log-uniformly (as many documents from 1k to 2k as from 16k to
  32k: many short documents, a few long ones), seeded (seed 0, or `@SEED`);
- `64k:64k`: one document.

Documents are laid back to back until they fill TOTAL tokens; the last one is cut to fit, so it may be shorter
than LENGTH or MIN.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..model.documents import Documents

SYNTAX = "TOTAL:LENGTH or TOTAL:MIN-MAX[@SEED], sizes in tokens or with k for 1024 (e.g. 64k:2k, 64k:1k-32k)"
_SPEC = re.compile(r"(?P<total>\w+):(?P<low>\w+)(?:-(?P<high>\w+))?(?:@(?P<seed>\d+))?")


@dataclass(frozen=True)
class Mixture:
    """Documents packed into one stream of `total` tokens."""

    spec: str
    """The spec as written (the results' row label)."""
    lengths: tuple[int, ...]
    """Each document's tokens, in stream order; they sum to the total."""

    @property
    def total(self) -> int:
        return sum(self.lengths)


def parse_mixture(spec: str) -> Mixture:
    """The mixture `spec` describes (module docstring), or a UserError naming what is wrong with it."""
    match = _SPEC.fullmatch(spec.strip())
    if match is None:
        raise UserError(f"document mixture '{spec}' is not {SYNTAX}")
    total, low = _size(match["total"], spec), _size(match["low"], spec)
    high = _size(match["high"], spec) if match["high"] else low
    if low > high:
        raise UserError(f"document mixture '{spec}': the shortest length {low} exceeds the longest {high}; "
                        "write MIN-MAX with MIN <= MAX")
    if high > total:
        raise UserError(f"document mixture '{spec}': documents of up to {high} tokens do not fit in {total}; "
                        "give a TOTAL at least MAX")
    return Mixture(spec.strip(), draw_lengths(total, low, high, int(match["seed"] or 0)))


def parse_mixtures(text: str) -> list[Mixture]:
    """Comma-separated specs (the --docs argument)."""
    specs = [s for s in text.split(",") if s.strip()]
    if not specs:
        raise UserError(f"--docs needs at least one document mixture: {SYNTAX}")
    return [parse_mixture(s) for s in specs]


def _size(text: str, spec: str) -> int:
    match = re.fullmatch(r"(\d+)(k?)", text.lower())
    if match is None or int(match[1]) == 0:
        raise UserError(f"document mixture '{spec}': '{text}' is not a positive size; write tokens (2048) or "
                        "multiples of 1024 with k (2k)")
    return int(match[1]) * (1024 if match[2] else 1)


def draw_lengths(total: int, low: int, high: int, seed: int = 0) -> tuple[int, ...]:
    """Document lengths in [low, high], log-uniform, that fill `total` tokens with the last one cut to fit; the
    same for the same arguments on every machine (Python's own generator, not the device's)."""
    rng = random.Random(seed)
    lengths, left = [], total
    while left:
        drawn = low if low == high else round(math.exp(rng.uniform(math.log(low), math.log(high))))
        lengths.append(min(drawn, left))
        left -= lengths[-1]
    return tuple(lengths)


def cu_seqlens(mixture: Mixture, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [N + 1]: the documents' boundaries, flash-attn's varlen convention (docs/design.md#packed-documents)."""
    bounds = [0]
    for length in mixture.lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def document_ids(mixture: Mixture, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [total]: each token's document index, as the model reads it."""
    return Documents.from_cu_seqlens(cu_seqlens(mixture, device), 1, mixture.total).ids


def document_mask_mod(ids: torch.Tensor):
    """FlexAttention's mask_mod of causal attention within documents: key s is seen by query t when s <= t and
    both lie in one document (ids: document_ids)."""

    def causal_same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return (kv_idx <= q_idx) & (ids[q_idx] == ids[kv_idx])

    return causal_same_document


def document_block_mask(mixture: Mixture, device: torch.device | str, block_size: int = 128):
    """FlexAttention's BlockMask of document_mask_mod over the packed stream (batch 1, every head alike): built
    once per mixture, as a model builds it once per batch for all its layers."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids(mixture, device)
    return create_block_mask(document_mask_mod(ids), 1, None, mixture.total, mixture.total, device=device,
                             BLOCK_SIZE=block_size)


def jagged(values: torch.Tensor, mixture: Mixture, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A packed [total, heads, D] tensor as a nested jagged tensor [N, heads, j, D] (a view: gradients reach
    `values`), the layout SDPA's varlen flash and cuDNN kernels take. `offsets` (cu_seqlens as int64 on values'
    device), when given, spares a copy to the device on every call; the lengths' bounds come from the mixture, so
    nothing waits for the device."""
    if offsets is None:
        offsets = cu_seqlens(mixture, values.device).to(torch.int64)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(mixture.lengths),
                                                    max_seqlen=max(mixture.lengths))
    return nested.transpose(1, 2)
