"""Choosing the next token from logits: greedy, or temperature with top-k and top-p (nucleus) filtering.

The one place every generator draws its tokens (`nsa generate`, the trainer's end-of-run sample, cached and
uncached decoding) and the one definition of a greedy pick (`nsa eval`'s exact match).
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise a UserError naming the setting and a valid example when one is out of range."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}; "
                        "e.g. --temperature 0.8")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1] (1 = off), got {top_p}; e.g. --top-p 0.95")
    if top_k < 0:
        raise UserError(f"top_k must be >= 0 (0 = off), got {top_k}; e.g. --top-k 50")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The likeliest token of every row of logits [..., V] (the first of equal ones)."""
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [B,V]: greedy when temperature == 0, else a filtered sample."""
    if temperature == 0:
        return greedy(logits)
    logits = logits.float() / temperature  # softmax over a bf16 head's logits in float32
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the more likely ones already reach top_p; the most likely always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
