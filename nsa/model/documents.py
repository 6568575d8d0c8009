"""Packed documents in a batch: where each document starts, in the forms the layers read.

A batch [B, T] of packed sequences is one stream of B * T tokens cut into documents by `cu_seqlens` (int32
[N + 1], flash-attn's varlen convention: document i is tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1 of the
flattened batch). Every sequence boundary is a document boundary too. Trailing entries may repeat B * T (empty
documents), so that a loader can pad the boundaries to a fixed count and keep shapes static for torch.compile
and CUDA graphs. See docs/design.md#packed-documents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn.attention.flex_attention import BlockMask

from .document_mask import document_block_mask


@dataclass(frozen=True)
class Documents:
    """The document structure of a batch of B sequences of T tokens."""

    cu_seqlens: torch.Tensor
    """int32 [N + 1]: document boundaries over the B * T tokens of the flattened batch."""
    positions: torch.Tensor
    """int64 [B, T]: each token's position in its document (RoPE's positions)."""
    ids: torch.Tensor
    """int64 [B * T]: each token's document index (masks such as FlexAttention's compare them)."""
    block_mask: BlockMask | None = None
    """FlexAttention's mask of causal attention within these documents (with_block_mask), for dense attention on a
    GPU; None until built."""

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> Documents:
        """The structure of a [batch, seq_len] batch cut by cu_seqlens, which must start at 0, never decrease, end
        at batch * seq_len and hold every multiple of seq_len (sequences never share a document)."""
        cu = cu_seqlens.to(torch.int64)
        tokens = torch.arange(batch * seq_len, device=cu.device)
        # A token belongs to the last document that starts at or before it (empty documents start where the
        # next one does, so `right=True` skips them).
        ids = torch.searchsorted(cu, tokens, right=True) - 1
        positions = tokens - cu[ids]
        return Documents(cu_seqlens.to(torch.int32), positions.view(batch, seq_len), ids)

    def with_block_mask(self) -> Documents:
        """These documents with their FlexAttention block mask, built now: the model builds it once per forward,
        outside the compiled blocks, for all its layers (nsa.model.document_mask)."""
        return replace(self, block_mask=document_block_mask(self.ids.view_as(self.positions), self.positions))

    @property
    def starts(self) -> torch.Tensor:
        """int64 [B * T]: the flattened index of each token's document start."""
        return self.cu_seqlens.to(torch.int64)[self.ids]
