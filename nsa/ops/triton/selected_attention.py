"""The selected branch's gathered kernels: block-centric in both directions, per query for large groups.

Query t attends to the tokens s <= t of its group's n selected blocks. While a sequence has few selection blocks
the branch runs tiled (span_attention's MODE_SEL); beyond, nsa.ops.dispatch.selected_path picks one of:

- block-centric (groups of fewer than 16 heads): loading each query's blocks separately reads n * l' keys and
  values per query and is bound by cache bandwidth. Instead an inverse index (inverse_index.py) lists, for every
  (batch, group, block), the queries that chose it; work items of at most `Tuning.inverse_chunk` queries each load
  their block's keys and values once and loop over the queries' (query, head) rows:
  - forward (block_partials): each item writes, per (query, slot, head), the block's partial output and its
    log-sum-exp; `finalize` merges a query's n partials exactly (like split-K attention) and applies the gates of
    all three branches in the same pass;
  - backward (block_backward): each item accumulates its block's dK/dV in registers (one float32 atomic add per
    element per item; only blocks chosen by more queries than one item holds have several) and writes each row's
    dQ contribution to a per-slot buffer, which the dQ kernel of every branch sums (query_grad.py): dQ needs no
    second gather of the keys. In deterministic mode each item writes its own partial dK/dV instead, summed in
    item order (sum_item_partials).
- per-query (groups of 16+ heads, whose h heads fill the matrix rows): token_forward and token_dq gather a query's
  n blocks; its dK/dV stays block-centric.

On sm_90 GPUs, for calls large enough, the block-centric kernels may run as the Gluon kernels of
nsa.ops.gluon.selected_forward and .selected_backward (same contracts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packing import PackedLayout
from ..tuning import TUNING
from . import launcher
from .common import (LOG2E, ceil_div, dot_precision, head_dims, ieee_products, load_grad_rows, load_tile, lower_bound,
                     next_power_of_two, softmax_finish, softmax_step, store_tile)


@triton.jit
def _item_block(ITEM_KEY, ITEM_START, item, K, V, skb, skt, skg, svb, svt, svg, T, G, NS, sel_block, dk, dv,
                BLOCK_START, BLOCK_END, DK: tl.constexpr, DV: tl.constexpr, BLOCK_L: tl.constexpr,
                PACKED: tl.constexpr):
    """A work item's block: (first entry, b, g, b * G + g, key positions (int32), key ok, K tile, V tile).

    Packed, block j is the stream's j-th selection block, tokens [BLOCK_START[j], BLOCK_END[j])."""
    key = tl.load(ITEM_KEY + item)  # (b * G + g) * NS + j
    j = key % NS
    bg = key // NS
    b = (bg // G).to(tl.int64)
    g = bg % G
    lk = tl.arange(0, BLOCK_L)
    if PACKED:
        pos = tl.load(BLOCK_START + j) + lk
        k_ok = pos < tl.load(BLOCK_END + j)
    else:
        pos = j * sel_block + lk
    kidx = pos.to(tl.int64)
    if not PACKED:
        k_ok = (lk < sel_block) & (pos < T)
    k = load_tile(K, b * skb + g * skg + kidx * skt, dk, k_ok, DK)
    v = load_tile(V, b * svb + g * svg + kidx * svt, dv, k_ok, DV)
    return tl.load(ITEM_START + item), b, g, bg, pos, k_ok, k, v


@triton.jit
def _item_rows(ENTRIES, start, r0, count, bg, T, n: tl.constexpr, h: tl.constexpr, BLOCK_R: tl.constexpr):
    """(row ok, flat entry f, query t, head-in-group) for rows r0.. of an item; rows are (entry, head).

    f = ((b * G + g) * T + t) * n + slot < 2**31 (the entries are int32), so t is found in 32 bits from the item's
    bg = b * G + g: an int64 division or modulo by a runtime value is a long subroutine call per row.
    """
    rows = r0 + tl.arange(0, BLOCK_R)
    row_ok = rows < count * h
    f = tl.load(ENTRIES + start + rows // h, mask=row_ok, other=0)
    t = tl.where(row_ok, f // n - bg * T, 0)
    return row_ok, f.to(tl.int64), t, rows % h


@triton.jit
def _item_grad_rows(Q, DO, LSE, DELTA, b, g, h, t, hh, row_ok, sqb, sqt, sqh, sdob, sdot, sdoh,
                    slb, slt, dk, dv, DK: tl.constexpr, DV: tl.constexpr):
    """The backward's gathered rows: q, do, the gated lse (log2 units) and delta (t int32)."""
    head = (g * h + hh).to(tl.int64)
    t = t.to(tl.int64)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    do, lse2, delta = load_grad_rows(DO, LSE, DELTA, b * sdob + t * sdot + head * sdoh, b * slb + t * slt + head,
                                     dv, row_ok, DV)
    return q, do, lse2, delta


@triton.jit
def _masked_steps(ENTRIES, start, count, bg, T, first, sel_block, n: tl.constexpr, h: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FULL: tl.constexpr):
    """The first row of an item's unmasked steps, for the block whose first token is `first`. Steps before it
    hold queries inside the item's block, which see only part of it (the causal mask); later rows see all of it.
    Entries are sorted by query, so those queries come first, and a block holds fewer than BLOCK_L of them. FULL:
    BLOCK_L == sel_block (else every step is masked: the tile's extra keys belong to the next block). A packed
    document's last block may hold fewer than l' tokens: its queries all lie before first + l' - 1, so they are
    all masked, and the tile's keys past the block (the next document's) stay out."""
    if FULL:
        e = tl.arange(0, BLOCK_L)
        t = tl.load(ENTRIES + start + e, mask=e < count, other=0) // n - bg * T
        inside = tl.sum(((e < count) & (t < first + sel_block - 1)).to(tl.int32))
        return tl.minimum(tl.cdiv(inside * h, BLOCK_R) * BLOCK_R, count * h)
    else:
        return count * h


@triton.jit
def _fwd_partial_rows(Q, OPART, LSEPART, ENTRIES, start, count, first, last, b, g, bg, T, k, v, pos, k_ok,
                      sqb, sqt, sqh, scale_log2, dk, dv, n: tl.constexpr, h: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, MASKED: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Each row's partial output and log-sum-exp (log2 units) over the item's block, for row steps [first, last).

    The scale is applied in the exponent's FMA (the row maximum of the raw scores, scale > 0), and the rows
    normalised by a reciprocal: one instruction per element each, instead of a multiply, a subtract and a
    division."""
    for r0 in range(first, last, BLOCK_R):
        row_ok, f, t, hh = _item_rows(ENTRIES, start, r0, count, bg, T, n, h, BLOCK_R)
        q = load_tile(Q, b * sqb + t.to(tl.int64) * sqt + (g * h + hh).to(tl.int64) * sqh, dk, row_ok, DK)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(k_ok[None, :] & (pos[None, :] <= t[:, None]), s, float("-inf"))
        m = tl.where(row_ok, tl.max(s, 1), 0.0) * scale_log2  # a selected block always holds a key <= t
        p = tl.exp2(s * scale_log2 - m[:, None])
        l_sum = tl.sum(p, 1)
        l_safe = tl.where(l_sum > 0, l_sum, 1.0)
        part = f * h + hh
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        store_tile(OPART, part * DV, dv, row_ok, pv * (1.0 / l_safe)[:, None], DV)
        tl.store(LSEPART + part, m + tl.log2(l_safe), mask=row_ok)


@triton.jit
def _block_first(ITEM_KEY, item, NS, sel_block, BLOCK_START, PACKED: tl.constexpr):
    """The first token of an item's block."""
    if PACKED:
        return tl.load(BLOCK_START + tl.load(ITEM_KEY + item) % NS)
    else:
        return (tl.load(ITEM_KEY + item) % NS) * sel_block


@triton.jit
def _sel_fwd_partial_kernel(
    Q, K, V, OPART, LSEPART, ITEM_KEY, ITEM_START, ITEM_COUNT, ENTRIES, BLOCK_START, BLOCK_END,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg,
    T, G, NS, n: tl.constexpr, h: tl.constexpr, scale_log2, sel_block,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FULL: tl.constexpr, PACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    count = tl.load(ITEM_COUNT + item)
    if count > 0:
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        start, b, g, bg, pos, k_ok, k, v = _item_block(ITEM_KEY, ITEM_START, item, K, V, skb, skt, skg, svb, svt, svg,
                                                    T, G, NS, sel_block, dk, dv, BLOCK_START, BLOCK_END, DK, DV,
                                                    BLOCK_L, PACKED)
        split = _masked_steps(ENTRIES, start, count, bg, T, _block_first(ITEM_KEY, item, NS, sel_block, BLOCK_START,
                                                                         PACKED),
                              sel_block, n, h, BLOCK_L, BLOCK_R, FULL)
        _fwd_partial_rows(Q, OPART, LSEPART, ENTRIES, start, count, 0, split, b, g, bg, T, k, v, pos, k_ok,
                          sqb, sqt, sqh, scale_log2, dk, dv, n, h, DK, DV, BLOCK_R, True, DOT_PRECISION)
        _fwd_partial_rows(Q, OPART, LSEPART, ENTRIES, start, count, split, count * h, b, g, bg, T, k, v, pos, k_ok,
                          sqb, sqt, sqh, scale_log2, dk, dv, n, h, DK, DV, BLOCK_R, False, DOT_PRECISION)


@triton.jit
def _token_rows(pid_bg, G, h, HP: tl.constexpr):
    """(b, g, row ok, head) of a per-query program: its rows are the h heads of group g (padded to HP)."""
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    r = tl.arange(0, HP)
    return b, g, r < h, (g * h + tl.where(r < h, r, 0)).to(tl.int64)


@triton.jit
def _token_block(IDX, idx_off, slot, K, V, kbase, vbase, skt, svt, t, sel_block, lk, dk, dv, BLOCK_START, BLOCK_END,
                 first_block, DK: tl.constexpr, DV: tl.constexpr, PACKED: tl.constexpr):
    """Keys/values of query t's slot-th selected block, masked to positions <= t (all masked for -1). Packed, the
    document-relative block j is the stream's block first_block + j, tokens [BLOCK_START[.], BLOCK_END[.])."""
    j = tl.load(IDX + idx_off + slot)
    if PACKED:
        block = first_block + j
        kidx = (tl.load(BLOCK_START + block, mask=j >= 0, other=0) + lk).to(tl.int64)
        k_ok = (kidx < tl.load(BLOCK_END + block, mask=j >= 0, other=0)) & (kidx <= t)
    else:
        kidx = j * sel_block + lk
        k_ok = (j >= 0) & (lk < sel_block) & (kidx <= t)
    return k_ok, load_tile(K, kbase + kidx * skt, dk, k_ok, DK), load_tile(V, vbase + kidx * svt, dv, k_ok, DV)


@triton.jit
def _first_block(SEL_START, t, PACKED: tl.constexpr):
    """Packed: the stream's index of query t's document's first selection block (unused otherwise)."""
    if PACKED:
        return tl.load(SEL_START + t)
    else:
        return 0


@triton.jit
def _sel_token_fwd_kernel(
    Q, K, V, IDX, O, LSE, SEL_START, BLOCK_START, BLOCK_END,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sib, sit, sig, sob, sot, soh, slb, slt,
    T, G, h, scale_log2, sel_block, n_sel,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, BLOCK_L: tl.constexpr, PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b, g, row_ok, head = _token_rows(tl.program_id(1), G, h, HP)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    lk = tl.arange(0, BLOCK_L)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    first_block = _first_block(SEL_START, t, PACKED)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    for slot in range(n_sel):
        k_ok, k, v = _token_block(IDX, b * sib + t * sit + g * sig, slot, K, V, b * skb + g * skg, b * svb + g * svg,
                                  skt, svt, t, sel_block, lk, dk, dv, BLOCK_START, BLOCK_END, first_block, DK, DV,
                                  PACKED)
        s = tl.where(k_ok[None, :], tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, scale_log2, row_ok, False, DOT_PRECISION)
    out, lse = softmax_finish(m_i, l_i, acc)  # the current block is always selected: l_i > 0
    store_tile(O, b * sob + t * sot + head * soh, dv, row_ok, out, DV)
    tl.store(LSE + b * slb + t * slt + head, lse, mask=row_ok)


@triton.jit
def _sel_token_dq_kernel(
    Q, K, V, IDX, DO, LSE, DELTA, DQ, SEL_START, BLOCK_START, BLOCK_END,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sib, sit, sig, sdob, sdot, sdoh, slb, slt,
    sdqb, sdqt, sdqh,
    T, G, h, scale_log2, scale, sel_block, n_sel,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, HP: tl.constexpr, BLOCK_L: tl.constexpr, PACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b, g, row_ok, head = _token_rows(tl.program_id(1), G, h, HP)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    lk = tl.arange(0, BLOCK_L)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    do, lse2, delta = load_grad_rows(DO, LSE, DELTA, b * sdob + t * sdot + head * sdoh, b * slb + t * slt + head,
                                     dv, row_ok, DV)
    dq = tl.zeros([HP, BLOCK_DK], tl.float32)
    first_block = _first_block(SEL_START, t, PACKED)
    for slot in range(n_sel):
        k_ok, k, v = _token_block(IDX, b * sib + t * sit + g * sig, slot, K, V, b * skb + g * skg, b * svb + g * svg,
                                  skt, svt, t, sel_block, lk, dk, dv, BLOCK_START, BLOCK_END, first_block, DK, DV,
                                  PACKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        p = tl.where(k_ok[None, :] & row_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    store_tile(DQ, b * sdqb + t * sdqt + head * sdqh, dk, row_ok, dq * scale, DK)


@triton.jit
def _slot_lse(IDX, LSEPART, idx_off, part0, s, n, h, row_ok):
    """[rows] log-sum-exp (log2 units) of each row's slot-s partial; -inf where the slot chose no block."""
    j = tl.load(IDX + idx_off + s, mask=row_ok & (s < n), other=-1)
    return tl.load(LSEPART + part0 + s * h, mask=j >= 0, other=float("-inf"))


@triton.jit
def _finalize_kernel(
    OPART, LSEPART, IDX, O_CMP, O_WIN, GATES, O, O_SEL, LSE_SEL,
    sib, sit, sig, sob, sot, soh, sgb, sgt, sgh, slb, slt,
    T, G, h: tl.constexpr, n,
    MERGE: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, NP: tl.constexpr,
):
    """o = sum of the gated branch outputs; with MERGE, o_sel is first merged from its per-block partials."""
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * h
    t = (rows // h).to(tl.int64)
    hh = rows % h
    head = (g * h + hh).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    row_off = b * sob + t * sot + head * soh
    if MERGE:
        # Exact split-softmax merge of the partials (each normalised by its own sum, lse in log2 units). The
        # slots are unrolled and the maximum taken first, so no partial's read waits on another's.
        part0 = (((b * G + g) * T + t) * n) * h + hh  # slot s of the row: part0 + s * h
        idx_off = b * sib + t * sit + g * sig
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in tl.static_range(NP):
            m = tl.maximum(m, _slot_lse(IDX, LSEPART, idx_off, part0, s, n, h, row_ok))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for s in tl.static_range(NP):  # the slots' lse read again (cached) rather than held as NP vectors
            w = tl.exp2(_slot_lse(IDX, LSEPART, idx_off, part0, s, n, h, row_ok) - m_safe)  # 0 for empty slots
            # Empty slots' partials were never written: masked, not multiplied by 0.
            o = load_tile(OPART, (part0 + s * h) * DV, dv, row_ok & (w > 0), DV)
            acc += w[:, None] * o.to(tl.float32)
            l_sum += w
        l_safe = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(LSE_SEL + b * slb + t * slt + head, (m + tl.log2(l_safe)) / 1.4426950408889634, mask=row_ok)
        store_tile(O_SEL, row_off, dv, row_ok, acc / l_safe[:, None], DV)
    # The stored (rounded) o_sel enters the sum, as it will in backward.
    o_sel = load_tile(O_SEL, row_off, dv, row_ok, DV).to(tl.float32)
    gate_off = b * sgb + t * sgt + head * sgh
    g_cmp = tl.load(GATES + gate_off, mask=row_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(GATES + gate_off + 1, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(GATES + gate_off + 2, mask=row_ok, other=0.0).to(tl.float32)
    o_cmp = load_tile(O_CMP, row_off, dv, row_ok, DV).to(tl.float32)
    o_win = load_tile(O_WIN, row_off, dv, row_ok, DV).to(tl.float32)
    store_tile(O, row_off, dv, row_ok, g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win, DV)


@triton.jit
def _bwd_rows(Q, DO, LSE, DELTA, DQPART, ENTRIES, start, count, first, last, b, g, bg, T, k, v, pos, k_ok,
              dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2,
              sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, scale_log2, scale, dk, dv,
              n: tl.constexpr, h: tl.constexpr, WRITE_DQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_R: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The block's dK/dV (and each row's dQ partial) over row steps [first, last). The gathers run ahead of the
    math (they depend on the entries, which the loop cannot pipeline): each step loads the next step's rows and
    the entries of the step after, carried in (ok1, ...) and (ok2, ...). The forward's partials load their rows
    in step: there the carried registers cost more than the latency they hide."""
    for r0 in range(first, last, BLOCK_R):
        row_ok, f, t, hh, q, do, lse2, delta = ok1, f1, t1, hh1, q1, do1, lse1, delta1
        ok1, f1, t1, hh1 = ok2, f2, t2, hh2
        q1, do1, lse1, delta1 = _item_grad_rows(Q, DO, LSE, DELTA, b, g, h, t1, hh1, ok1, sqb, sqt, sqh,
                                                sdob, sdot, sdoh, slb, slt, dk, dv, DK, DV)
        ok2, f2, t2, hh2 = _item_rows(ENTRIES, start, r0 + 2 * BLOCK_R, count, bg, T, n, h, BLOCK_R)
        # Rows-major tiles, transposed for the dK/dV products: keys-major ones avoid the transposes but run slower.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_R, BLOCK_L]
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        if MASKED:
            p = tl.where(k_ok[None, :] & row_ok[:, None] & (pos[None, :] <= t[:, None]), p, 0.0)
        else:  # rows past the item's end (last step) gathered row 0 of q and do, with lse and delta 0
            p = tl.where(row_ok[:, None], p, 0.0)
        dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
        if WRITE_DQ:
            dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
            store_tile(DQPART, (f * h + hh) * DK, dk, row_ok, dq * scale, DK)
    return dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2


@triton.jit
def _sel_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DKo, DVo, DQPART, ITEM_KEY, ITEM_START, ITEM_COUNT, ENTRIES, BLOCK_START, BLOCK_END,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, slb, slt,
    sdkb, sdkt, sdkg, sdvb, sdvt, sdvg,
    T, G, NS, n: tl.constexpr, h: tl.constexpr, scale_log2, scale, sel_block,
    WRITE_DQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FULL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PARTIALS: tl.constexpr = False, PACKED: tl.constexpr = False,
):
    item = tl.program_id(0)
    count = tl.load(ITEM_COUNT + item)
    if count > 0:
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        start, b, g, bg, pos, k_ok, k, v = _item_block(ITEM_KEY, ITEM_START, item, K, V, skb, skt, skg, svb, svt, svg,
                                                    T, G, NS, sel_block, dk, dv, BLOCK_START, BLOCK_END, DK, DV,
                                                    BLOCK_L, PACKED)
        split = _masked_steps(ENTRIES, start, count, bg, T, _block_first(ITEM_KEY, item, NS, sel_block, BLOCK_START,
                                                                         PACKED),
                              sel_block, n, h, BLOCK_L, BLOCK_R, FULL)
        dk_acc = tl.zeros([BLOCK_L, BLOCK_DK], tl.float32)
        dv_acc = tl.zeros([BLOCK_L, BLOCK_DV], tl.float32)
        ok1, f1, t1, hh1 = _item_rows(ENTRIES, start, 0, count, bg, T, n, h, BLOCK_R)
        q1, do1, lse1, delta1 = _item_grad_rows(Q, DO, LSE, DELTA, b, g, h, t1, hh1, ok1, sqb, sqt, sqh,
                                                sdob, sdot, sdoh, slb, slt, dk, dv, DK, DV)
        ok2, f2, t2, hh2 = _item_rows(ENTRIES, start, BLOCK_R, count, bg, T, n, h, BLOCK_R)
        dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2 = _bwd_rows(
            Q, DO, LSE, DELTA, DQPART, ENTRIES, start, count, 0, split, b, g, bg, T, k, v, pos, k_ok,
            dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2,
            sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, scale_log2, scale, dk, dv, n, h, WRITE_DQ, DK, DV, BLOCK_R,
            True, DOT_PRECISION)
        dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2 = _bwd_rows(
            Q, DO, LSE, DELTA, DQPART, ENTRIES, start, count, split, count * h, b, g, bg, T, k, v, pos, k_ok,
            dk_acc, dv_acc, ok1, f1, t1, hh1, q1, do1, lse1, delta1, ok2, f2, t2, hh2,
            sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, scale_log2, scale, dk, dv, n, h, WRITE_DQ, DK, DV, BLOCK_R,
            False, DOT_PRECISION)
        if PARTIALS:  # deterministic mode: the item's own [BLOCK_L, D] slot, summed by _sum_item_partials_kernel
            lk = tl.arange(0, BLOCK_L).to(tl.int64)
            store_tile(DKo + item.to(tl.int64) * (BLOCK_L * DK), lk * DK, dk, lk < BLOCK_L, dk_acc * scale, DK)
            store_tile(DVo + item.to(tl.int64) * (BLOCK_L * DV), lk * DV, dv, lk < BLOCK_L, dv_acc, DV)
        else:
            # Relaxed atomics: a sum needs no ordering, and Triton's default (acq_rel) fences the whole GPU.
            kidx = pos.to(tl.int64)
            tl.atomic_add(DKo + (b * sdkb + g * sdkg + kidx * sdkt)[:, None] + dk[None, :], dk_acc * scale,
                          mask=k_ok[:, None] & (dk[None, :] < DK), sem="relaxed")
            tl.atomic_add(DVo + (b * sdvb + g * sdvg + kidx * sdvt)[:, None] + dv[None, :], dv_acc,
                          mask=k_ok[:, None] & (dv[None, :] < DV), sem="relaxed")


@triton.jit
def _sum_item_partials_kernel(PART, ITEM_KEY, OUT, BLOCK_START, BLOCK_END, so_b, so_t, so_g, n_items, T, G, NS,
                              sel_block, D: tl.constexpr, BLOCK_L: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_D: tl.constexpr, STEPS: tl.constexpr, PACKED: tl.constexpr):
    """Deterministic mode: block key's dK (or dV) rows [r0, r0 + ROWS) as the sum, in item order, of its work
    items' partials PART [n_items, BLOCK_L, D] (float32); a block nobody chose gets 0. A key's items are
    consecutive in the inverse index, and its item_key ascends (unused items hold the largest key)."""
    key = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    ends = lower_bound(ITEM_KEY, n_items, key + tl.arange(0, 2), STEPS)  # the key's first item, and the next key's
    first = tl.sum(tl.where(tl.arange(0, 2) == 0, ends, 0))
    stop = tl.sum(tl.where(tl.arange(0, 2) == 1, ends, 0))
    r = r0 + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    off = r[:, None] * D + d[None, :]
    ok = (r < BLOCK_L)[:, None] & (d < D)[None, :]
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    ptr = PART + first.to(tl.int64) * (BLOCK_L * D) + off
    for _ in tl.range(first, stop, num_stages=3):
        acc += tl.load(ptr, mask=ok, other=0.0)
        ptr += BLOCK_L * D
    j = key % NS
    bg = key // NS
    if PACKED:
        pos = tl.load(BLOCK_START + j) + r
        row_ok = pos < tl.load(BLOCK_END + j)
    else:
        pos = j * sel_block + r
        row_ok = (r < sel_block) & (pos < T)
    store_tile(OUT + (bg // G).to(tl.int64) * so_b + (bg % G) * so_g, pos.to(tl.int64) * so_t, d, row_ok, acc, D)


# ---------------------------------------------------------------- launchers


def _strides(*tensors) -> tuple:
    return tuple(s for t in tensors for s in t.stride()[:3])


def _block_tables(layout: PackedLayout | None) -> tuple:
    """The stream's selection blocks (BLOCK_START, BLOCK_END) for the kernels: None unpacked (constexpr, so that
    unpacked launches compile as if the tables did not exist)."""
    return (None, None) if layout is None else (layout.block_start, layout.block_end)


def num_block_keys(T: int, sel_block: int, layout: PackedLayout | None = None) -> int:
    """NS, the selection blocks a sequence's block keys (b * G + g) * NS + j count: ceil(T / l'), or packed the
    stream's block capacity."""
    return -(-T // sel_block) if layout is None else layout.num_blocks


def _item_launch(q: torch.Tensor, dv: int) -> dict:
    if q.device.type != "cuda":
        return dict(BLOCK_R=16, num_warps=1)
    if ieee_products(q):
        return dict(BLOCK_R=16, num_warps=8, num_stages=1)
    if max(q.shape[-1], dv) > 64:
        if q.element_size() == 4:  # TF32: 128 rows of 32-bit tiles at head dim 128 exceed sm_90's shared memory
            return dict(BLOCK_R=32, num_warps=8)
        return dict(BLOCK_R=TUNING.sel_block_r_wide, num_warps=TUNING.sel_warps_wide)
    return dict(BLOCK_R=TUNING.sel_block_r, num_warps=TUNING.sel_warps)


def block_tile(sel_block: int) -> dict:
    """The block-centric kernels' key tile: the block (FULL) or, for a block size that is not a power of two,
    the next one up (whose extra keys every row masks)."""
    block_l = max(16, next_power_of_two(sel_block))
    return dict(BLOCK_L=block_l, FULL=block_l == sel_block)


def _token_launch(q: torch.Tensor, h: int, sel_block: int) -> dict:
    launch = dict(HP=max(16, next_power_of_two(h)), BLOCK_L=max(16, next_power_of_two(sel_block)))
    return launch | (dict(num_warps=TUNING.token_warps) if q.device.type == "cuda" else dict(num_warps=1))


def _row_launch(q: torch.Tensor) -> dict:
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, num_warps=1)
    return dict(BLOCK_M=TUNING.row_block_m, num_warps=TUNING.row_warps)


def token_forward(q, k, v, indices, o_sel, lse_sel, scale: float, sel_block: int,
                  layout: PackedLayout | None = None) -> None:
    """The per-query forward: o_sel [B,T,H,Dv] and lse_sel [B,T,H] (float32) of every query over its chosen blocks
    (with `layout`, a packed stream's document-relative ones)."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    h, n = H // G, indices.shape[-1]
    sel_start = None if layout is None else layout.sel_start
    launcher.launch(_sel_token_fwd_kernel, (T, B * G),
        q, k, v, indices, o_sel, lse_sel, sel_start, *_block_tables(layout), *_strides(q, k, v, indices, o_sel),
        *lse_sel.stride()[:2], T, G, h, scale * LOG2E, sel_block, n, **head_dims(Dk, Dv),
        **_token_launch(q, h, sel_block), PACKED=layout is not None, DOT_PRECISION=dot_precision(q.dtype),
    )


def block_partials(q, k, v, inverse, opart, lsepart, scale: float, sel_block: int, n: int,
                   layout: PackedLayout | None = None) -> None:
    """The block-centric forward: every (query, slot, head)'s partial output and log-sum-exp (log2 units) over its
    block, into opart [B*G*T*n, h, Dv] and lsepart [B*G*T*n, h]; `inverse` from inverse_index.build_inverse_index
    (with the same `layout`)."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    item_key, item_start, item_count, entries = inverse
    launcher.launch(_sel_fwd_partial_kernel, (item_key.numel(),),
        q, k, v, opart, lsepart, item_key, item_start, item_count, entries, *_block_tables(layout),
        *_strides(q, k, v), T, G, num_block_keys(T, sel_block, layout), n, H // G, scale * LOG2E, sel_block,
        **head_dims(Dk, Dv), **block_tile(sel_block), **_item_launch(q, Dv), PACKED=layout is not None,
        DOT_PRECISION=dot_precision(q.dtype),
    )


def finalize(opart, lsepart, indices, o_cmp, o_win, gates, o, o_sel, lse_sel, merge: bool) -> None:
    """o = the gated sum of the three branches; with `merge`, o_sel and lse_sel are first merged from the
    block-centric partials (exactly, like split-K attention)."""
    B, T, H, Dv = o.shape
    G, n = indices.shape[2], indices.shape[-1]
    h = H // G
    cfg = _row_launch(o)
    launcher.launch(_finalize_kernel, (ceil_div(T * h, cfg["BLOCK_M"]), B * G),
        opart, lsepart, indices, o_cmp, o_win, gates, o, o_sel, lse_sel,
        *indices.stride()[:3], *o.stride()[:3], *gates.stride()[:3], *lse_sel.stride()[:2],
        T, G, h, n, MERGE=merge, DV=Dv, BLOCK_DV=max(16, next_power_of_two(Dv)),
        NP=next_power_of_two(n), **cfg,
    )


def block_backward(q, k, v, do, lse, delta, dk_acc, dv_acc, dqpart, inverse, scale: float, sel_block: int, n: int,
                   write_dq: bool, partials: bool, layout: PackedLayout | None = None) -> None:
    """The block-centric backward: adds each block's dK/dV into dk_acc/dv_acc (float32 [B,T,G,D], zeroed), or with
    `partials` writes each item's to its slot of dk_acc/dv_acc [items, BLOCK_L, D] (sum_item_partials adds them);
    with write_dq, each row's dQ share into dqpart [B*G*T*n, h, Dk] (q's type).

    do is the gradient of the gated sum; lse and delta [B,T,H] are the branch's gated ones from
    gating.gate_grads (lse_sel - ln(gate), rowsum(do * o_sel))."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    item_key, item_start, item_count, entries = inverse
    out_strides = (0,) * 6 if partials else _strides(dk_acc, dv_acc)
    launcher.launch(_sel_bwd_kernel, (item_key.numel(),),
        q, k, v, do, lse, delta, dk_acc, dv_acc, dqpart, item_key, item_start, item_count, entries,
        *_block_tables(layout), *_strides(q, k, v, do), *lse.stride()[:2], *out_strides,
        T, G, num_block_keys(T, sel_block, layout), n, H // G, scale * LOG2E, scale, sel_block, WRITE_DQ=write_dq,
        **head_dims(Dk, Dv), **block_tile(sel_block), **_item_launch(q, Dv), PARTIALS=partials,
        PACKED=layout is not None, DOT_PRECISION=dot_precision(q.dtype),
    )


def sum_item_partials(part: torch.Tensor, item_key: torch.Tensor, out: torch.Tensor, T: int, G: int,
                      sel_block: int, layout: PackedLayout | None = None) -> None:
    """out [B, T, G, D] (float32) <- per block, its items' partials part [n_items, BLOCK_L, D], in item order."""
    B, D = out.shape[0], out.shape[-1]
    block_l = block_tile(sel_block)["BLOCK_L"]
    NS = num_block_keys(T, sel_block, layout)
    rows = min(block_l, 16) if out.is_cuda else block_l
    n_items = item_key.numel()
    launcher.launch(_sum_item_partials_kernel, (B * G * NS, -(-block_l // rows)),
        part, item_key, out, *_block_tables(layout), out.stride(0), out.stride(1), out.stride(2), n_items, T, G, NS,
        sel_block, D=D, BLOCK_L=block_l, ROWS=rows, BLOCK_D=max(16, next_power_of_two(D)),
        STEPS=max(1, n_items.bit_length()), PACKED=layout is not None, num_warps=4 if out.is_cuda else 1)


def token_dq(q, k, v, indices, do, lse, delta, dq, scale: float, sel_block: int,
             layout: PackedLayout | None = None) -> None:
    """The per-query dQ of the selected branch into dq (float32 [B,T,H,Dk], scaled)."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    h, n = H // G, indices.shape[-1]
    sel_start = None if layout is None else layout.sel_start
    launcher.launch(_sel_token_dq_kernel, (T, B * G),
        q, k, v, indices, do, lse, delta, dq, sel_start, *_block_tables(layout), *_strides(q, k, v, indices, do),
        *lse.stride()[:2], *dq.stride()[:3], T, G, h, scale * LOG2E, scale, sel_block, n,
        **head_dims(Dk, Dv), **_token_launch(q, h, sel_block), PACKED=layout is not None,
        DOT_PRECISION=dot_precision(q.dtype),
    )
