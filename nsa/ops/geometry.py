"""NSA's block geometry: the five hyper-parameters, their rules, and the formulas every backend shares.

Compressed block i covers tokens [i*d, i*d + l); selection block j covers [j*l', (j+1)*l')
(docs/design.md#hyper-parameters, docs/design.md#block-geometry). `NSAGeometry` holds (l, d, l', n, w)
checked once, when it is built; the functions below are the single source of the formulas.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

import torch

FIELDS = ("block_len", "block_stride", "sel_block", "n_sel", "window")
"""NSAGeometry's fields, in order: the keyword names of the public ops."""


@dataclass(frozen=True)
class NSAGeometry:
    """The NSA hyper-parameters that fix which keys each query sees. Building one checks the rules of
    docs/design.md#hyper-parameters and raises ValueError naming the broken one."""

    block_len: int
    """Compression block length l: raw tokens summarised by one compressed token."""
    block_stride: int
    """Stride d between compressed blocks; divides block_len and sel_block."""
    sel_block: int
    """Selection block length l': the unit the selected branch attends to."""
    n_sel: int
    """Selected blocks per query n, the three forced ones (block 0, the current and the previous) included."""
    window: int
    """Sliding-window length w of the window branch."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                number = operator.index(value)
            except TypeError:
                raise ValueError(f"{f.name} must be an integer, got {value!r}") from None
            object.__setattr__(self, f.name, number)  # numpy or torch integers become plain ints
            if number < 1:
                raise ValueError(f"{f.name} must be >= 1, got {number}")
        if self.block_len % self.block_stride or self.sel_block % self.block_stride:
            raise ValueError(
                f"block_stride ({self.block_stride}) must divide block_len ({self.block_len}) and sel_block "
                f"({self.sel_block}); e.g. block_stride=16, block_len=32, sel_block=64"
            )
        if self.n_sel < 3:
            raise ValueError(f"n_sel must be >= 3 to hold the three forced blocks, got {self.n_sel}")

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """(block_len, block_stride, sel_block, n_sel, window): the form custom ops take (no dataclass arguments).
        Spelled out: dataclasses.astuple deep-copies each field, a cost on every eager call."""
        return self.block_len, self.block_stride, self.sel_block, self.n_sel, self.window

    def num_compressed_blocks(self, seq_len: int) -> int:
        """Nc for a sequence of seq_len tokens."""
        return num_compressed_blocks(seq_len, self.block_len, self.block_stride)

    def num_selection_blocks(self, seq_len: int) -> int:
        """Ns for a sequence of seq_len tokens."""
        return num_selection_blocks(seq_len, self.sel_block)

    def compressed_block_ends(self, num_blocks: int, device=None) -> torch.Tensor:
        """Last token position covered by each of the first num_blocks compressed blocks."""
        return compressed_block_ends(num_blocks, self.block_len, self.block_stride, device)

    def overlap_matrix(self, num_cmp: int, num_sel: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """The Eq. 9 weights [Nc, Ns] (overlap_matrix)."""
        return overlap_matrix(num_cmp, num_sel, self.block_len, self.block_stride, self.sel_block, dtype, device)


def geometry_from(geometry: NSAGeometry | None, **values: int | None) -> NSAGeometry:
    """`geometry`, or the one the keyword values (the five of FIELDS, or a selection's four without window) build:
    exactly one of the two forms. The selection never reads the window, so a geometry built from four values gets
    window 1."""
    given = {name: value for name, value in values.items() if value is not None}
    if geometry is not None:
        if given:
            raise ValueError(f"pass either geometry= or {', '.join(values)}, not both (got both geometry and "
                             f"{', '.join(given)})")
        return geometry
    missing = [name for name in values if name not in given]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}: pass all of {', '.join(values)}, or geometry=NSAGeometry(...)")
    return NSAGeometry(**({"window": 1} | given))


def num_compressed_blocks(seq_len: int, block_len: int, block_stride: int) -> int:
    """Nc = floor((T - l) / d) + 1, or 0 when T < l."""
    if seq_len < block_len:
        return 0
    return (seq_len - block_len) // block_stride + 1


def num_selection_blocks(seq_len: int, sel_block: int) -> int:
    """Number of selection blocks that hold at least one of the T tokens."""
    return -(-seq_len // sel_block)


def compressed_block_ends(num_blocks: int, block_len: int, block_stride: int, device=None) -> torch.Tensor:
    """Last token position covered by each compressed block: i*d + l - 1."""
    return torch.arange(num_blocks, device=device) * block_stride + block_len - 1


def overlap_matrix(
    num_cmp: int, num_sel: int, block_len: int, block_stride: int, sel_block: int, dtype=torch.float32, device=None
) -> torch.Tensor:
    """M[i, j] = |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, the Eq. 9 weights (shape [Nc, Ns])."""
    starts = torch.arange(num_cmp, device=device) * block_stride
    sel_starts = torch.arange(num_sel, device=device) * sel_block
    lo = torch.maximum(starts[:, None], sel_starts[None, :])
    hi = torch.minimum(starts[:, None] + block_len, sel_starts[None, :] + sel_block)
    return (hi - lo).clamp_min(0).to(dtype) / block_stride


def compressed_offsets(cu_seqlens: torch.Tensor, geometry: NSAGeometry) -> torch.Tensor:
    """int32 [N + 1]: where each packed document's compressed tokens start in k_cmp/v_cmp (and, last, how many
    rows they fill), for documents cut by cu_seqlens [N + 1] (docs/design.md#packed-documents). On the device of
    cu_seqlens, without a host sync."""
    return row_offsets(cu_seqlens, geometry.block_len, geometry.block_stride)


def packed_block_starts(cu_seqlens: torch.Tensor, block_len: int, block_stride: int,
                        rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the first `rows` rows of a packed k_cmp: (the first token of the block each row compresses, int64
    [rows]; whether the row holds a compressed token, bool [rows]). Row r of document i compresses the document's
    block r - offsets[i], which starts at cu_seqlens[i] + (r - offsets[i]) * d; rows past the last document's
    compressed tokens hold none (their start reads 0). On the device of cu_seqlens, without a host sync."""
    offsets = row_offsets(cu_seqlens, block_len, block_stride).to(torch.int64)
    row = torch.arange(rows, device=cu_seqlens.device)
    # The last document starting at or before the row; empty documents start where the next one does.
    doc = (torch.searchsorted(offsets, row, right=True) - 1).clamp(max=cu_seqlens.numel() - 2)
    valid = row < offsets[-1]
    starts = cu_seqlens.to(torch.int64)[doc] + (row - offsets[doc]) * block_stride
    return torch.where(valid, starts, 0), valid


def row_offsets(cu_seqlens: torch.Tensor, block_len: int, block_stride: int) -> torch.Tensor:
    """compressed_offsets from the compression geometry alone (block_len, block_stride)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    counts = torch.where(lengths >= block_len, (lengths - block_len) // block_stride + 1, 0)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
