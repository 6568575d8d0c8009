"""The inverse of the selection: for every (batch, group, block), the queries that chose it, in work items.

Three small kernels around one device sort, with no host sync (the number of work items is a
bound known on the host): the entries' keys, each key's range in the sorted order (binary
search) and its number of items, then the items themselves. The same in plain torch took ~35
small operations, whose launch time bound a call at batch 1 below 16k tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
"""Entries or keys per program."""


@triton.jit
def _entry_keys_kernel(IDX, KEYS, sib, sit, sig, T, G, NS, n_keys, total, n: tl.constexpr, BLOCK: tl.constexpr):
    """Key (b * G + g) * NS + j of every flat entry f = ((b * G + g) * T + t) * n + slot; n_keys for unused slots."""
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # total < 2**31: the entries are int32
    ok = f < total
    bgt = f // n
    t = bgt % T
    bg = bgt // T
    j = tl.load(IDX + (bg // G).to(tl.int64) * sib + t.to(tl.int64) * sit + bg % G * sig + f % n, mask=ok, other=-1)
    tl.store(KEYS + f, tl.where(j >= 0, bg * NS + j.to(tl.int32), n_keys), mask=ok)


@triton.jit
def _lower_bound(SORTED, size, key, STEPS: tl.constexpr):
    """First position in SORTED[0:size] holding a value >= key (size if none), for each key."""
    lo = tl.zeros_like(key)
    hi = lo + size
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = lo + (hi - lo) // 2
        v = tl.load(SORTED + mid, mask=active, other=0)
        lo = tl.where(active & (v < key), mid + 1, lo)
        hi = tl.where(active & (v >= key), mid, hi)
    return lo


@triton.jit
def _key_ranges_kernel(SORTED, STARTS, COUNTS, ITEMS, size, n_keys, chunk, STEPS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Each key's first position and count in the sorted keys, and its number of work items."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = k < n_keys
    start = _lower_bound(SORTED, size, k, STEPS)
    count = _lower_bound(SORTED, size, k + 1, STEPS) - start
    tl.store(STARTS + k, start, mask=ok)
    tl.store(COUNTS + k, count, mask=ok)
    tl.store(ITEMS + k, (count + chunk - 1) // chunk, mask=ok)


@triton.jit
def _items_kernel(STARTS, COUNTS, ITEMS, ITEM_END, ITEM_KEY, ITEM_START, ITEM_COUNT, n_keys, chunk,
                  BLOCK: tl.constexpr):
    """Key k's items are ITEM_END[k] - ITEMS[k] .. ITEM_END[k] - 1, chunk entries each (the last one the rest)."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = k < n_keys
    items = tl.load(ITEMS + k, mask=ok, other=0)
    first = tl.load(ITEM_END + k, mask=ok, other=0) - items
    start = tl.load(STARTS + k, mask=ok, other=0)
    count = tl.load(COUNTS + k, mask=ok, other=0)
    for w in range(0, tl.max(items, 0)):
        mine = w < items
        tl.store(ITEM_KEY + first + w, k, mask=mine)
        tl.store(ITEM_START + first + w, start + w * chunk, mask=mine)
        tl.store(ITEM_COUNT + first + w, tl.minimum(count - w * chunk, chunk), mask=mine)


def _key_dtype(n_keys: int) -> torch.dtype:
    """The narrowest type holding keys 0 .. n_keys: torch.sort sorts integers by radix, one pass per byte (at M7C
    4k x 1, 129 keys, uint8 takes one pass instead of int32's four)."""
    if n_keys <= torch.iinfo(torch.uint8).max:
        return torch.uint8
    if n_keys <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def inverse_index(indices: torch.Tensor, num_sel_blocks: int, chunk: int):
    """Work items over the (query, slot) entries that chose each block.

    Returns (item_key, item_start, item_count, entries), int32: item i covers
    entries[item_start[i] : item_start[i] + item_count[i]], flat indices into
    indices.permute(0, 2, 1, 3) ([B,G,T,n]) of queries that selected block j of key
    (b * G + g) * Ns + j, ascending in t. The number of items is a bound known on the
    host (no sync); unused items have count 0 and key B * G * Ns, so item_key ascends.
    """
    B, T, G, n = indices.shape
    total, n_keys = B * G * T * n, B * G * num_sel_blocks
    if total >= 2**31:
        raise ValueError(f"the inverse index holds fewer than 2**31 (query, slot) entries, got {total}")
    dev = indices.device
    keys = torch.empty(total, device=dev, dtype=_key_dtype(n_keys))
    _entry_keys_kernel[(triton.cdiv(total, _BLOCK),)](
        indices, keys, *indices.stride()[:3], T, G, num_sel_blocks, n_keys, total, n=n, BLOCK=_BLOCK)
    sorted_keys, entries = torch.sort(keys, stable=True)  # stable: t ascending within a key
    starts, counts, items = (torch.empty(n_keys, device=dev, dtype=torch.int32) for _ in range(3))
    grid = (triton.cdiv(n_keys, _BLOCK),)
    _key_ranges_kernel[grid](sorted_keys, starts, counts, items, total, n_keys, chunk,
                             STEPS=max(1, total.bit_length()), BLOCK=_BLOCK)
    item_end = torch.cumsum(items, 0, dtype=torch.int32)
    max_items = total // chunk + n_keys
    # Unused items keep key n_keys, past every real one: item_key ascends over the whole array, so a key's items
    # can be found by binary search (the deterministic backward's sums, selected_attention.py).
    item_key = torch.full((max_items,), n_keys, device=dev, dtype=torch.int32)
    item_start = torch.empty_like(item_key)
    item_count = torch.zeros_like(item_key)
    _items_kernel[grid](starts, counts, items, item_end, item_key, item_start, item_count, n_keys, chunk,
                        BLOCK=_BLOCK)
    return item_key, item_start, item_count, entries.to(torch.int32)
