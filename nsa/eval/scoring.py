"""Scores that need one no-grad forward: exact match of answers, and validation loss.

Exact match by teacher forcing: greedy decoding reproduces the answer exactly when, at every answer
position, the argmax given the true prefix is the true next token (by induction over the answer's tokens,
each greedy step then sees the same prefix). So one batched forward over prompt + answer decides it, with
no sampling loop and no decode cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..data.loader import Batch, split_batch
from ..inference.sampler import greedy
from ..train.loop import autocast_context


def answer_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits [B,A,V] at the given positions [B,A] of tokens [B,T].

    A `Transformer` applies its output head at those positions only (full logits at 64k tokens and a GPT-2
    vocabulary take gigabytes); any other model is called for full logits [B,T,V].
    """
    if hasattr(model, "hidden") and hasattr(model, "lm_head"):
        h = model.hidden(tokens)
        picked = h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1]))
        return model.lm_head(picked)
    logits = model(tokens)
    return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))


@torch.no_grad()
def answer_hits(model: nn.Module, tokens: torch.Tensor, answer_start: torch.Tensor,
                answer_len: torch.Tensor) -> torch.Tensor:
    """bool [B,A], A the longest answer: whether the argmax at answer position j, given the true prefix, is the
    answer's j-th token; positions past a row's answer count as hits.

    tokens [B,T] hold prompt then answer, the answer of row b at [answer_start[b], answer_start[b] +
    answer_len[b]) (rows may differ). The model reads tokens[:, :-1], as the trainer reads an example of
    seq_len + 1 tokens: the last token is only ever a target, and an example built for a training length
    puts its question at the positions training did. Runs under bf16 autocast on CUDA, fp32 elsewhere.
    Column 0 says whether the model fetched the answer at all; the later columns, whether it kept copying.
    """
    device = tokens.device
    if (answer_start < 1).any() or (answer_len < 1).any() or (answer_start + answer_len > tokens.shape[1]).any():
        raise ValueError("every answer needs a prompt token before it, at least one token, and to fit in tokens")
    offsets = torch.arange(int(answer_len.max()), device=device)
    valid = offsets[None, :] < answer_len[:, None]
    targets_at = torch.where(valid, answer_start[:, None] + offsets[None, :], answer_start[:, None])
    with autocast_context("auto", device):
        logits = answer_logits(model, tokens[:, :-1], targets_at - 1)
    right = greedy(logits) == tokens.gather(1, targets_at)
    return right | ~valid


def exact_match(model: nn.Module, tokens: torch.Tensor, answer_start: torch.Tensor,
                answer_len: torch.Tensor) -> torch.Tensor:
    """bool [B]: the argmax at every answer position, given the true prefix, is the answer's token
    (`answer_hits`, every column)."""
    return answer_hits(model, tokens, answer_start, answer_len).all(-1)


@dataclass
class ValidationLoss:
    loss: float
    """Mean next-token cross-entropy (nats per token) over the batches."""
    batches: int
    tokens: int
    """Targets scored (ignored targets, -1, excluded)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Iterable[Batch], device: torch.device) -> ValidationLoss | None:
    """The trainer's loss (mean cross-entropy per token) over held-out (inputs, targets[, cu_seqlens]) batches,
    each batch weighted equally as in training's validation; None without batches."""
    losses, tokens = [], 0
    for batch in batches:
        x, y, cu_seqlens = split_batch(batch)
        args = (x.to(device), y.to(device)) + (() if cu_seqlens is None else (cu_seqlens.to(device),))
        with autocast_context("auto", device):
            losses.append(float(model(*args).float()))
        tokens += int((y != -1).sum())  # ignored targets (-1) do not count
    if not losses:
        return None
    return ValidationLoss(sum(losses) / len(losses), len(losses), tokens)
