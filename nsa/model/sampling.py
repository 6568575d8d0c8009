"""Text generation by repeated full forward passes (simple and exact; KV-cached decoding is separate)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    context: int,
    temperature: float = 0.8,
    top_k: int = 50,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend prompt [B,T0] by max_new_tokens tokens, conditioning on at most `context` tokens."""
    was_training = model.training
    model.eval()
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -context:])[:, -1].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    model.train(was_training)
    return tokens
