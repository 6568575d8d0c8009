"""The names the dispatcher and both kernel packages share for NSA's branches.

- MODE_*: which keys a query row sees in the span kernels (nsa.ops.triton.span_attention, nsa.ops.gluon): the
  compressed branch, the window branch, or the selected branch run tiled (a causal prefix masked by the choices).
  The kernels take them as compile-time integers.
- TILED, TOKEN, BLOCKS: the three paths of the selected branch (nsa.ops.dispatch.selected_path).
- SEL_* and SelectedDQ: the selected branch's share of dQ, in whichever form its path's backward leaves it for
  the dQ kernel of every branch (query_grad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODE_CMP = 0
"""Query t sees compressed tokens 0 .. floor((t - l + 1) / d)."""
MODE_WIN = 1
"""Query t sees raw tokens max(0, t - w + 1) .. t."""
MODE_SEL = 2
"""Query t sees raw tokens 0 .. t of the blocks its group chose (one 64-bit mask a query)."""

TILED, TOKEN, BLOCKS = "tiled", "per-token", "block-centric"

SEL_NONE, SEL_TILED, SEL_PARTS, SEL_DENSE = 0, 1, 2, 3
"""Kinds of SelectedDQ: no selected branch (a branch timed alone); the tiled path's keys, walked by the dQ kernel;
the block-centric path's per-slot partials; a float32 dQ written by the per-query kernel or added by the Gluon
block-centric one."""


@dataclass
class SelectedDQ:
    """The selected branch's share of dQ, as its backward left it."""

    kind: int
    k: torch.Tensor | None = None
    """SEL_TILED: the branch's keys [B,T,G,Dk] ..."""
    v: torch.Tensor | None = None
    """... and values."""
    choice: torch.Tensor | None = None
    """SEL_TILED: the chosen blocks as bits [B,T,G]; SEL_PARTS and SEL_DENSE: the indices [B,T,G,n]."""
    parts: torch.Tensor | None = None
    """SEL_PARTS: per-(query, slot, head) partials [B*G*T*n, h, Dk], already scaled."""
    dq: torch.Tensor | None = None
    """SEL_DENSE: float32 [B,T,H,Dk], already scaled."""

    def dense(self) -> torch.Tensor:
        """SEL_PARTS or SEL_DENSE as a float32 dQ [B,T,H,Dk] (the partials summed over the used slots; unused slots'
        partials are never written). For checks and benchmarks: the dQ kernel reads the partials in place."""
        if self.kind == SEL_DENSE:
            return self.dq
        if self.kind != SEL_PARTS:
            raise ValueError(f"only the partials or a dense dQ can be summed, not kind {self.kind}")
        B, T, G, n = self.choice.shape
        h, Dk = self.parts.shape[1:]
        used = (self.choice.permute(0, 2, 1, 3) >= 0)[..., None, None]
        summed = torch.where(used, self.parts.float().view(B, G, T, n, h, Dk), 0.0).sum(3)
        return summed.permute(0, 2, 1, 3, 4).reshape(B, T, G * h, Dk)
