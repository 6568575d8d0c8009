"""Rotary position embedding (rotate-half convention), one table shared by queries and every key."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions; computed in float32 on each call.

    No buffer is kept: a frequency table cast to bf16 along with the model (or left
    uninitialised on the meta device) would silently corrupt every position.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [..., T, 1, head_dim/2] for integer positions [..., T]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        angles = positions.to(torch.float32)[..., None] * inv_freq
        return angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B,T,heads,D] by the angles of its token positions (in at least float32)."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
