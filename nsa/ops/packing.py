"""Lookup tables of packed documents for the kernels: built on the device from cu_seqlens, without a host sync
and without a loop over documents, so that one launch serves every document of a packed stream.

A kernel reads, for each query token, where its document starts and ends and where its compressed tokens and
selection blocks begin; for each compressed row, the token at which its block completes; for each selection
block of the stream, the tokens it holds. With them every rule of docs/design.md#packed-documents becomes a
range check in packed coordinates:

- compressed: query p sees rows [cmp_start[p], cmp_start[p] + Nc(t + 1)), t = p - doc_start[p];
- window: query p sees tokens [max(doc_start[p], p - w + 1), p];
- selected: query p's document-relative block j is the stream's block sel_start[p] + j, which holds tokens
  [block_start[.], block_end[.]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import NSAGeometry, compressed_offsets, packed_block_starts

_I32 = torch.int32


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed document's tokens, compressed rows and selection blocks lie (int32 tensors)."""

    doc_start: torch.Tensor
    """[total]: the first token of each token's document."""
    doc_end: torch.Tensor
    """[total]: one past the last token of each token's document."""
    cmp_start: torch.Tensor
    """[total]: the first compressed row (of k_cmp/v_cmp) of each token's document."""
    cmp_ready: torch.Tensor
    """[C]: for each compressed row, the first token that sees it (its block's last token); `total` for rows that
    hold no compressed token."""
    cmp_doc_end: torch.Tensor
    """[C]: one past the last token of each compressed row's document; `total` for rows that hold none."""
    sel_start: torch.Tensor
    """[total]: the stream's index of the first selection block of each token's document."""
    block_start: torch.Tensor
    """[S]: the first token of each selection block of the stream (documents' blocks back to back)."""
    block_end: torch.Tensor
    """[S]: one past the last token of each selection block; equal to block_start for the unused tail."""

    @property
    def num_blocks(self) -> int:
        """S: the selection blocks' capacity (static for a given total and number of boundaries)."""
        return self.block_start.numel()


def selection_block_capacity(total: int, boundaries: int, sel_block: int) -> int:
    """An upper bound on the selection blocks of `boundaries - 1` documents of `total` tokens: each document of
    L tokens has ceil(L / l') <= L / l' + 1 of them. Depends on shapes only, so buffers sized by it are static."""
    return -(-total // sel_block) + boundaries - 1


def packed_layout(cu_seqlens: torch.Tensor, geometry: NSAGeometry, total: int, cmp_rows: int) -> PackedLayout:
    """The tables of the documents cut by cu_seqlens (int32 [N+1], ending at `total`) for a k_cmp of `cmp_rows`
    rows."""
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total, device=device)
    doc = torch.searchsorted(cu, token, right=True) - 1  # empty documents start where the next one does
    lengths = cu[1:] - cu[:-1]

    starts, valid = packed_block_starts(cu_seqlens, geometry.block_len, geometry.block_stride, cmp_rows)
    offsets = compressed_offsets(cu_seqlens, geometry).to(torch.int64)
    row_doc = (torch.searchsorted(offsets, torch.arange(cmp_rows, device=device), right=True) - 1).clamp(
        max=lengths.numel() - 1)
    cmp_ready = torch.where(valid, starts + geometry.block_len - 1, total)
    cmp_doc_end = torch.where(valid, cu[row_doc + 1], total)

    blocks_per_doc = -(-lengths // geometry.sel_block)
    block_offsets = torch.cat([blocks_per_doc.new_zeros(1), blocks_per_doc.cumsum(0)])
    capacity = selection_block_capacity(total, cu.numel(), geometry.sel_block)
    block = torch.arange(capacity, device=device)
    block_doc = (torch.searchsorted(block_offsets, block, right=True) - 1).clamp(max=lengths.numel() - 1)
    used = block < block_offsets[-1]
    block_start = torch.where(used, cu[block_doc] + (block - block_offsets[block_doc]) * geometry.sel_block, total)
    block_end = torch.where(used, torch.minimum(block_start + geometry.sel_block, cu[block_doc + 1]), total)

    return PackedLayout(
        doc_start=cu[doc].to(_I32), doc_end=cu[doc + 1].to(_I32), cmp_start=offsets[doc].to(_I32),
        cmp_ready=cmp_ready.to(_I32), cmp_doc_end=cmp_doc_end.to(_I32), sel_start=block_offsets[doc].to(_I32),
        block_start=block_start.to(_I32), block_end=block_end.to(_I32),
    )
