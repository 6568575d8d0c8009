"""Document boundaries of a batch, for per-document attention masking (docs/data.md#document-masking).

A batch x [B, T] is read as one stream of B * T tokens. Its boundaries, `cu_seqlens`, follow flash-attn's
varlen convention (document i is tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1 of the flattened batch; see
nsa.model.documents) and are always padded to B * T + 1 entries, the most a batch can have (every token a
document of its own), by repeating B * T: empty documents. So every batch of a run has the same shapes, which
torch.compile and CUDA graphs need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def padded(starts: torch.Tensor, total: int) -> torch.Tensor:
    """int32 [total + 1]: the sorted document starts [N] (0 first), then `total` repeated to fill."""
    cu = torch.full((total + 1,), total, dtype=torch.int32)
    cu[: starts.numel()] = starts.to(torch.int32)
    return cu


def eot_boundaries(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Boundaries of documents joined by end-of-text: a document starts at position 0 of every row and right
    after every end-of-text token of x [B, T] (the end-of-text belongs to the document it ends)."""
    starts = torch.zeros(x.shape, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = x[:, :-1] == eot_id
    return padded(starts.flatten().nonzero().flatten(), x.numel())


def row_boundaries(x: torch.Tensor) -> torch.Tensor:
    """Boundaries of a batch x [B, T] that holds one document per row."""
    b, t = x.shape
    return padded(torch.arange(0, b * t, t), b * t)


def boundaries_for(source: str, eot_id: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a data source's batches x [B, T] are cut into documents: one example per row for the retrieval
    source, end-of-text between documents for every other source."""
    if source == "retrieval":
        return row_boundaries
    return lambda x: eot_boundaries(x, eot_id)
