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

from .geometry import NSAGeometry, compressed_offsets, num_compressed_blocks, packed_block_starts, row_offsets

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

    block_offsets, block_start, block_end = _document_blocks(cu, geometry.sel_block, total)

    return PackedLayout(
        doc_start=cu[doc].to(_I32), doc_end=cu[doc + 1].to(_I32), cmp_start=offsets[doc].to(_I32),
        cmp_ready=cmp_ready.to(_I32), cmp_doc_end=cmp_doc_end.to(_I32), sel_start=block_offsets[doc].to(_I32),
        block_start=block_start.to(_I32), block_end=block_end.to(_I32),
    )


def _document_blocks(cu: torch.Tensor, size: int, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each document of cu (int64 [N+1]) cut into blocks of `size` tokens from its first token, the stream's
    blocks back to back in document order: (the index of each document's first block [N+1], each block's first
    token and one past its last [selection_block_capacity]; `total` for the unused tail)."""
    lengths = cu[1:] - cu[:-1]
    per_doc = -(-lengths // size)
    offsets = torch.cat([per_doc.new_zeros(1), per_doc.cumsum(0)])
    block = torch.arange(selection_block_capacity(total, cu.numel(), size), device=cu.device)
    doc = (torch.searchsorted(offsets, block, right=True) - 1).clamp(max=lengths.numel() - 1)
    used = block < offsets[-1]
    start = torch.where(used, cu[doc] + (block - offsets[doc]) * size, total)
    end = torch.where(used, torch.minimum(start + size, cu[doc + 1]), total)
    return offsets, start, end


@dataclass(frozen=True)
class CompressionLayout:
    """Where phi's blocks lie in a packed stream (int32 tensors), for the compression kernels. A token's blocks
    follow from its document-relative position t = p - doc_start[p]: document block i covers t in [i*d, i*d + l)
    and is row cmp_start[p] + i of the output when i < Nc(document's length)."""

    row_start: torch.Tensor
    """[rows]: the first token of the block each output row compresses; `total` for rows that hold none (the
    documents' rows come first, back to back)."""
    chunk_start: torch.Tensor
    """[K]: the first token of each chunk of d tokens of a document (each document cut into chunks from its
    first token, the last one possibly shorter); `total` for the unused tail. Chunk k of a document is the first
    d tokens of its block k and the last d of its block k - 1 (l = 2d)."""
    doc_start: torch.Tensor
    """[total]: the first token of each token's document."""
    doc_end: torch.Tensor
    """[total]: one past the last token of each token's document."""
    cmp_start: torch.Tensor
    """[total]: the first output row of each token's document."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tables in field order."""
        return self.row_start, self.chunk_start, self.doc_start, self.doc_end, self.cmp_start


def compression_layout(cu_seqlens: torch.Tensor, block_len: int, block_stride: int, total: int) -> CompressionLayout:
    """The tables of phi (blocks of block_len tokens, block_stride apart, inside each document) over the documents
    cut by cu_seqlens (int32 [N+1], ending at `total`), for an output of Nc(total) rows, enough for any packing."""
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu, token, right=True) - 1  # empty documents start where the next one does
    rows = num_compressed_blocks(total, block_len, block_stride)
    starts, valid = packed_block_starts(cu_seqlens, block_len, block_stride, rows)
    offsets = row_offsets(cu_seqlens, block_len, block_stride).to(torch.int64)
    chunk_start = _document_blocks(cu, block_stride, total)[1]
    return CompressionLayout(
        row_start=torch.where(valid, starts, total).to(_I32), chunk_start=chunk_start.to(_I32),
        doc_start=cu[doc].to(_I32), doc_end=cu[doc + 1].to(_I32), cmp_start=offsets[doc].to(_I32),
    )
