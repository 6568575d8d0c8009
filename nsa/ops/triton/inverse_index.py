"""The inverse of the selection: for every (batch, group, block), the queries that chose it, in work items.

Small kernels around one device sort, with no host sync (the number of work items is a bound
known on the host): the entries' keys; each key's range in the sorted order, from the positions
where the key changes, and its number of items; then the items, one a lane. A few launches instead of
the dozens of small operations plain torch would take, whose launch time bounds short calls.

build_inverse_index lays the index out with the launch parameters of `Tuning` (inverse_chunk, inverse_query_ranges,
inverse_min_range) for the block-centric selected kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packing import PackedLayout
from ..tuning import TUNING
from . import launcher
from .common import ceil_div, deterministic, lower_bound

_BLOCK = 1024
"""Entries or keys per program."""


@triton.jit
def _entry_keys_kernel(IDX, KEYS, SEL_START, sib, sit, sig, T, G, NS, NQ, query_range, n_keys, total, n: tl.constexpr,
                       BLOCK: tl.constexpr, PACKED: tl.constexpr):
    """Sort key ((b * G + g) * NQ + t // query_range) * NS + j of every flat entry f = ((b * G + g) * T + t) * n +
    slot; n_keys for unused slots. Packed, j is the stream's block: the document-relative index plus the first
    block of t's document (SEL_START[t])."""
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # total < 2**31: the entries are int32
    ok = f < total
    bgt = f // n
    t = bgt % T
    bg = bgt // T
    j = tl.load(IDX + (bg // G).to(tl.int64) * sib + t.to(tl.int64) * sit + bg % G * sig + f % n, mask=ok, other=-1)
    if PACKED:
        j = tl.where(j >= 0, j + tl.load(SEL_START + t, mask=ok, other=0), j)
    tl.store(KEYS + f, tl.where(j >= 0, (bg * NQ + t // query_range) * NS + j.to(tl.int32), n_keys), mask=ok)


@triton.jit
def _key_bounds_kernel(SORTED, STARTS, ENDS, total, n_keys, BLOCK: tl.constexpr):
    """Each present key's first position and one past its last in the sorted keys, from the positions where the
    key changes (absent keys keep the zeros they were given: count 0)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < total
    key = tl.load(SORTED + p, mask=ok, other=0).to(tl.int32)
    prev = tl.load(SORTED + p - 1, mask=ok & (p > 0), other=-1).to(tl.int32)
    nxt = tl.load(SORTED + p + 1, mask=p + 1 < total, other=-1).to(tl.int32)
    real = ok & (key < n_keys)  # the sort's last keys may be n_keys, the unused slots
    tl.store(STARTS + key, p, mask=real & ((p == 0) | (key != prev)))
    tl.store(ENDS + key, p + 1, mask=real & ((p + 1 == total) | (key != nxt)))


@triton.jit
def _key_items_kernel(STARTS, ENDS, ITEMS, n_keys, chunk, BLOCK: tl.constexpr):
    """Each key's number of work items (ENDS becomes its count)."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = k < n_keys
    count = tl.load(ENDS + k, mask=ok, other=0) - tl.load(STARTS + k, mask=ok, other=0)
    tl.store(ENDS + k, count, mask=ok)
    tl.store(ITEMS + k, (count + chunk - 1) // chunk, mask=ok)


@triton.jit
def _items_kernel(STARTS, COUNTS, ITEMS, ITEM_END, ITEM_KEY, ITEM_START, ITEM_COUNT, n_keys, max_items, chunk, NS,
                  NQ, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Item i belongs to the first sort key k with ITEM_END[k] > i, as its (i - first item of k)-th chunk of
    entries, and gets k's block key (b * G + g) * NS + j; items past the last key's get the block key past every
    real one and count 0. One item a lane: a block that every query chooses (block 0) has T / chunk items, which
    a loop over a key's items would walk alone."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < max_items
    lo = lower_bound(ITEM_END, n_keys, i + 1, STEPS)  # the first key k with ITEM_END[k] > i
    used = ok & (lo < n_keys)
    k = tl.where(used, lo, 0)
    w = i - (tl.load(ITEM_END + k, mask=used, other=0) - tl.load(ITEMS + k, mask=used, other=0))
    start = tl.load(STARTS + k, mask=used, other=0) + w * chunk
    count = tl.minimum(tl.load(COUNTS + k, mask=used, other=0) - w * chunk, chunk)
    tl.store(ITEM_KEY + i, tl.where(used, k // (NQ * NS) * NS + k % NS, n_keys // NQ), mask=ok)
    tl.store(ITEM_START + i, tl.where(used, start, 0), mask=ok)
    tl.store(ITEM_COUNT + i, tl.where(used, count, 0), mask=ok)


def sort_key_dtype(n_keys: int) -> torch.dtype:
    """The narrowest type holding keys 0 .. n_keys: torch.sort sorts integers by radix, one pass per byte."""
    if n_keys <= torch.iinfo(torch.uint8).max:
        return torch.uint8
    if n_keys <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def num_items(B: int, T: int, G: int, n: int, num_sel_blocks: int, chunk: int, query_range: int) -> int:
    """Length of inverse_index's work-item arrays: a bound known on the host."""
    return B * G * T * n // chunk + B * G * -(-T // query_range) * num_sel_blocks


def inverse_index(indices: torch.Tensor, num_sel_blocks: int, chunk: int, query_range: int | None = None,
                  sel_start: torch.Tensor | None = None):
    """Work items over the (query, slot) entries that chose each block.

    Returns (item_key, item_start, item_count, entries), int32: item i covers
    entries[item_start[i] : item_start[i] + item_count[i]], flat indices into
    indices.permute(0, 2, 1, 3) ([B,G,T,n]) of queries that selected block j of key
    (b * G + g) * Ns + j, ascending in t. A block's queries are split into ranges of
    `query_range` tokens (default: T, no split), and the items ordered by (b, g, range, j):
    programs that run together then read the queries of one range. The number of items is a
    bound known on the host (no sync); unused items have count 0 and key B * G * Ns. Without
    a split, item_key ascends and a block's items are consecutive.

    Packed documents (B = 1): `sel_start` [T] (PackedLayout.sel_start) turns each query's document-relative
    index j into the stream's block sel_start[t] + j, of `num_sel_blocks` = PackedLayout.num_blocks; a block's
    queries are then those of its own document.
    """
    B, T, G, n = indices.shape
    query_range = T if query_range is None else query_range
    NQ = -(-T // query_range)
    total, n_keys = B * G * T * n, B * G * NQ * num_sel_blocks
    if total >= 2**31:
        raise ValueError(f"the inverse index holds fewer than 2**31 (query, slot) entries, got {total}")
    dev = indices.device
    keys = torch.empty(total, device=dev, dtype=sort_key_dtype(n_keys))
    launcher.launch(_entry_keys_kernel, (ceil_div(total, _BLOCK),),
        indices, keys, sel_start, *indices.stride()[:3], T, G, num_sel_blocks, NQ, query_range, n_keys, total, n=n,
        BLOCK=_BLOCK, PACKED=sel_start is not None)
    sorted_keys, entries = torch.sort(keys, stable=True)  # stable: t ascending within a key
    # `counts` holds each key's end position until _key_items_kernel subtracts the start (absent keys: 0 - 0).
    starts, counts = torch.zeros(2, n_keys, device=dev, dtype=torch.int32)
    items = torch.empty(n_keys, device=dev, dtype=torch.int32)
    launcher.launch(_key_bounds_kernel, (ceil_div(total, _BLOCK),),
                    sorted_keys, starts, counts, total, n_keys, BLOCK=_BLOCK)
    launcher.launch(_key_items_kernel, (ceil_div(n_keys, _BLOCK),), starts, counts, items, n_keys, chunk, BLOCK=_BLOCK)
    item_end = torch.cumsum(items, 0, dtype=torch.int32)
    max_items = num_items(B, T, G, n, num_sel_blocks, chunk, query_range)
    # Unused items get a key past every real one: unsplit, item_key ascends over the whole array, so a key's items
    # can be found by binary search (the deterministic backward's sums, selected_attention.sum_item_partials).
    item_key, item_start, item_count = (torch.empty(max_items, device=dev, dtype=torch.int32) for _ in range(3))
    launcher.launch(_items_kernel, (ceil_div(max_items, _BLOCK),),
                    starts, counts, items, item_end, item_key, item_start, item_count, n_keys, max_items, chunk,
                    num_sel_blocks, NQ, STEPS=n_keys.bit_length(), BLOCK=_BLOCK)
    return item_key, item_start, item_count, entries.to(torch.int32)


def inverse_layout(seq_len: int, device: torch.device) -> tuple[int, int]:
    """(entries per work item, tokens per query range) of the index for the block-centric kernels (Tuning.inverse_*);
    one range in deterministic mode, whose dK/dV sums need a block's items together."""
    cuda = device.type == "cuda"
    chunk = TUNING.inverse_chunk if cuda else 4
    if deterministic():
        return chunk, seq_len
    least = TUNING.inverse_min_range if cuda else 16
    return chunk, max(least, -(-seq_len // max(1, TUNING.inverse_query_ranges)))


def build_inverse_index(indices: torch.Tensor, seq_len: int, sel_block: int, layout: PackedLayout | None = None,
                        chunk: int | None = None):
    """inverse_index of the selection indices [B,T,G,n] in the block-centric kernels' layout (inverse_layout); with
    `layout`, of a packed stream's document-relative indices [1,total,G,n], keyed by the stream's selection blocks."""
    default_chunk, query_range = inverse_layout(seq_len, indices.device)
    if layout is None:
        return inverse_index(indices, -(-seq_len // sel_block), chunk or default_chunk, query_range)
    return inverse_index(indices, layout.num_blocks, chunk or default_chunk, query_range, layout.sel_start)


def built_items(batch: int, seq_len: int, groups: int, n: int, sel_block: int, device: torch.device,
                num_blocks: int | None = None) -> int:
    """Length of build_inverse_index's work-item arrays for these shapes, from metadata alone (torch.compile's fake
    tensors need it); packed, `num_blocks` is the layout's (packing.selection_block_capacity)."""
    blocks = -(-seq_len // sel_block) if num_blocks is None else num_blocks
    return num_items(batch, seq_len, groups, n, blocks, *inverse_layout(seq_len, device))
