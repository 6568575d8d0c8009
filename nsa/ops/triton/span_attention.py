"""Attention where each query sees one contiguous span of keys: the compressed and window branches, and the
selected branch while a sequence has few selection blocks (branches.MODE_*).

Compressed (MODE_CMP): query t sees compressed tokens 0 .. floor((t - l + 1) / d).
Window (MODE_WIN): query t sees raw tokens max(0, t - w + 1) .. t.
Selected, tiled (MODE_SEL): query t sees raw tokens 0 .. t of the blocks its group chose, given as one 64-bit mask
per query (chosen_bits). Tiles walk every key up to the causal edge, masked by the choices: dense causal work,
which is about what NSA does anyway while T is a few n * l' (most of the prefix is selected), at flash-attention
efficiency instead of gathering per block; longer sequences take selected_attention's gathered kernels.

Rows are packed as in common.py: a program's rows are (token, head) pairs of one key/value group.

The forward writes the branch output and its log-sum-exp. The backward is a dK/dV kernel here (one program per key
tile, looping over the rows that see it; compressed and selected key tiles split those rows over several programs
that add with float32 atomics) and query_grad's kernel, which walks every branch's keys for a tile of rows and
writes dQ once: a dK/dV kernel that also added dQ atomically would contend on those adds.

Each loop runs as masked edges around an interior (keys every row of the tile sees: no range mask; MODE_SEL still
masks by the choices, one bit per row and step; see common.interior).

Packed documents (a PackedLayout, PACKED on; B = 1): the same kernels in one launch for every document. Each row's
range comes from nsa.ops.packing's tables (the forward and dQ: its document's start and first compressed row; the
dK/dV kernel: each key's first and last query), MODE_SEL's choices count blocks from the row's document start,
and masks apply wherever a tile or step can hold two documents: the interior is computed from the same ranges, and
a tile of two documents has none (no key is seen by rows of both). Without a layout the flag is off and the
kernels compile as before.

On sm_90 GPUs nsa.ops.dispatch may run the Gluon kernels of nsa.ops.gluon.forward and .backward instead (same
contract); these Triton kernels serve everything else and are the ones the CPU tests check against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..tuning import TUNING
from . import launcher
from .common import (LOG2E, ceil_div, chosen_blocks, dot_precision, head_dims, interior, key_plan, key_step,
                     load_grad_rows, load_tile, next_power_of_two, num_sms, one_block, picked, picked_rows,
                     program_rows, softmax_finish, softmax_step, store_tile, tile_sizes, visible)


@triton.jit
def _picked_t(bits, kidx, sel_block):
    """picked transposed: [keys, rows]."""
    return ((bits[None, :] >> (kidx // sel_block)[:, None]) & 1) != 0


@triton.jit
def _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, first, last, lo, hi, row_ok, chosen, sel_block, doc_key, dk, dv,
              scale_log2, m_i, l_i, acc, MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
              PACKED: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """Online softmax over key steps [first, last); MASKED applies each row's visible range (and choice).
    PACKED, MODE_SEL: unmasked steps lie in one document, whose first key is doc_key."""
    for start in range(first, last, BLOCK_N):
        kidx, k, v = key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw: softmax_step scales
        pick = picked_rows(chosen, start, sel_block) if MODE == 2 and ONE_BLOCK else row_ok
        if MASKED:
            seen = visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE, ONE_BLOCK, PACKED)
            s = tl.where(seen, s, float("-inf"))
        elif MODE == 2 and PACKED:
            s = tl.where(picked(chosen, kidx - doc_key, sel_block), s, float("-inf"))
        elif MODE == 2 and not ONE_BLOCK:
            s = tl.where(picked(chosen, kidx, sel_block), s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, scale_log2, pick, MODE == 2 and ONE_BLOCK, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _span_fwd_kernel(
    Q, K, V, O, LSE, IDX, O_CMP, O_WIN, GATES, OUT, DOC_START, CMP_START,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sob, sot, soh, slb, slt, sib, sit, sig, sgb, sgt, sgh,
    T, NK, G, h: tl.constexpr, scale_log2, block_len, block_stride, window, sel_block,
    MODE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, GATED: tl.constexpr,
    PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b, g, row_ok, t, head = program_rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    lo, hi, k_start, k_end, chosen, a, e, doc_key = key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE,
                                                              block_len, block_stride, window, BLOCK_M, BLOCK_N,
                                                              PACKED, DOC_START, CMP_START)
    k_base = b * skb + g * skg
    v_base = b * svb + g * svg
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, k_start, a, lo, hi, row_ok, chosen, sel_block,
                              doc_key, dk, dv, scale_log2, m_i, l_i, acc, True, MODE, ONE_BLOCK, PACKED, DK, DV,
                              BLOCK_N, DOT_PRECISION)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, a, e, lo, hi, row_ok, chosen, sel_block,
                              doc_key, dk, dv, scale_log2, m_i, l_i, acc, False, MODE, ONE_BLOCK, PACKED, DK, DV,
                              BLOCK_N, DOT_PRECISION)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, e, k_end, lo, hi, row_ok, chosen, sel_block,
                              doc_key, dk, dv, scale_log2, m_i, l_i, acc, True, MODE, ONE_BLOCK, PACKED, DK, DV,
                              BLOCK_N, DOT_PRECISION)
    out, lse = softmax_finish(m_i, l_i, acc)
    o_off = b * sob + t * sot + head * soh
    store_tile(O, o_off, dv, row_ok, out, DV)
    tl.store(LSE + b * slb + t * slt + head, lse, mask=row_ok)
    if GATED:
        # MODE_SEL runs last at short T: it also writes o = sum of the gated branch outputs (all [B,T,H,Dv] with
        # O's strides), its own output rounded as stored, as backward will see it.
        gate_off = b * sgb + t * sgt + head * sgh
        g_cmp = tl.load(GATES + gate_off, mask=row_ok, other=0.0).to(tl.float32)
        g_sel = tl.load(GATES + gate_off + 1, mask=row_ok, other=0.0).to(tl.float32)
        g_win = tl.load(GATES + gate_off + 2, mask=row_ok, other=0.0).to(tl.float32)
        total = g_sel[:, None] * out.to(O.dtype.element_ty).to(tl.float32)
        total += g_cmp[:, None] * load_tile(O_CMP, o_off, dv, row_ok, DV).to(tl.float32)
        total += g_win[:, None] * load_tile(O_WIN, o_off, dv, row_ok, DV).to(tl.float32)
        store_tile(OUT, o_off, dv, row_ok, total, DV)


@triton.jit
def _sees(kidx, k_ok, t, row_ok, MODE: tl.constexpr, block_len, block_stride, window):
    """[keys, rows]: whether query token t sees key kidx (int32 both), false for keys or rows out of range. One
    compare per element (the ranges folded per key and per row); written per key, never dividing per row: an
    int64 division by a runtime stride is a long subroutine call on the GPU."""
    if MODE == 0:
        last = tl.where(k_ok, kidx * block_stride + block_len - 1, 2147483647)  # the first query that sees it
        return last[:, None] <= tl.where(row_ok, t, -1)[None, :]
    elif MODE == 1:  # 0 <= t - key < window, unsigned (keys past the end have key > t; rows past it, t = -2^30)
        return (tl.where(row_ok, t, -1073741824)[None, :] - kidx[:, None]).to(tl.uint32) < window.to(tl.uint32)
    else:  # keys past the end have key > t
        return kidx[:, None] <= tl.where(row_ok, t, -1)[None, :]


@triton.jit
def _key_queries(kidx, k_ok, T, DOC_START, DOC_END, CMP_READY, CMP_DOC_END, MODE: tl.constexpr, window, sel_block):
    """Packed documents: for each key of a tile, the first and last query that see it (none: T and -1), and for
    MODE_SEL the key's block in its document. A compressed row is seen from its block's last token to its
    document's end; a token from itself to its document's end, and a window key for at most `window` queries."""
    if MODE == 0:
        q_first = tl.load(CMP_READY + kidx, mask=k_ok, other=T)
        q_last = tl.load(CMP_DOC_END + kidx, mask=k_ok, other=0) - 1
        block = kidx
    else:
        k32 = kidx.to(tl.int32)
        doc_end = tl.load(DOC_END + kidx, mask=k_ok, other=0)
        q_first = tl.where(k_ok, k32, T)
        if MODE == 1:
            q_last = tl.minimum(doc_end, k32 + window) - 1
        else:
            q_last = doc_end - 1
        in_doc = k32 - tl.load(DOC_START + kidx, mask=k_ok, other=0)
        block = tl.minimum(in_doc // sel_block, 63).to(tl.int64)  # keys past the end clamp (the range masks them)
    return q_first, q_last, block


@triton.jit
def _sees_in_document(q_first, q_last, t, row_ok):
    """[keys, rows]: packed documents: whether query t lies in each key's range [q_first, q_last]."""
    tt = tl.where(row_ok, t, -1)[None, :]
    return (q_first[:, None] <= tt) & (tt <= q_last[:, None])


@triton.jit
def _picked_block_t(bits, key_block):
    """[keys, rows]: whether each row chose each key's block (given per key: packed documents)."""
    return ((bits[None, :] >> key_block[:, None]) & 1) != 0


@triton.jit
def _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h: tl.constexpr, first, last, split_hi,
               sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
               block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
               q_first, q_last, key_block,
               MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr, PACKED: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK/dV of one key tile over (token, head) row steps [first, last). PACKED: each key's queries are
    [q_first, q_last] and its block key_block (_key_queries)."""
    kidx32 = kidx.to(tl.int32)
    for r0 in range(first, last, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < split_hi
        t32 = rows // h  # h is a compile-time constant: a multiply, not a division
        t = t32.to(tl.int64)
        head = (g * h + rows % h).to(tl.int64)
        q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
        do, lse2, delta = load_grad_rows(DO, LSE, DELTA, b * sdob + t * sdot + head * sdoh, b * slb + t * slt + head,
                                         dv, row_ok, DV)
        if MODE == 2:
            bits = chosen_blocks(IDX, b * sib + t * sit + g * sig, row_ok)
            if ONE_BLOCK:
                lse2 = tl.where(picked_rows(bits, k_first, sel_block), lse2, float("inf"))
        pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2
                     - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            if PACKED:
                seen = _sees_in_document(q_first, q_last, t32, row_ok)
                if MODE == 2:
                    seen = seen & _picked_block_t(bits, key_block)
            else:
                seen = _sees(kidx32, k_ok, t32, row_ok, MODE, block_len, block_stride, window)
                if MODE == 2 and not ONE_BLOCK:
                    seen = seen & _picked_t(bits, kidx, sel_block)
            pt = tl.where(seen, pt, 0.0)
        elif MODE == 2 and PACKED:
            pt = tl.where(_picked_block_t(bits, key_block), pt, 0.0)
        elif MODE == 2 and not ONE_BLOCK:
            pt = tl.where(_picked_t(bits, kidx, sel_block), pt, 0.0)
        dv_acc += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :])
        dk_acc += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk_acc, dv_acc


@triton.jit
def _span_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DKo, DVo, IDX, DOC_START, DOC_END, CMP_READY, CMP_DOC_END,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, slb, slt,
    sdkb, sdkt, sdkg, sdvb, sdvt, sdvg, sdks, sdvs, sib, sit, sig,
    T, NK, G, h: tl.constexpr, scale_log2, scale, block_len, block_stride, window, sel_block, rows_per_split,
    MODE: tl.constexpr, ATOMIC: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr, PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_split = tl.program_id(1)
    pid_bg = tl.program_id(2)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    kidx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_ok = kidx < NK
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k_off = b * skb + g * skg + kidx * skt
    v_off = b * svb + g * svg + kidx * svt
    k = load_tile(K, k_off, dk, k_ok, DK)
    v = load_tile(V, v_off, dv, k_ok, DV)
    # Queries that can see any key of this tile ([t_lo, t_hi]), and those that see all of them ([f_lo, f_hi]).
    k_first = pid_n * BLOCK_N
    k_last = tl.minimum(NK - 1, k_first + BLOCK_N - 1)
    if PACKED:
        # From each key's own range: a tile of keys of two documents has no row that sees all of them.
        q_first, q_last, key_block = _key_queries(kidx, k_ok, T, DOC_START, DOC_END, CMP_READY, CMP_DOC_END, MODE,
                                                  window, sel_block)
        t_lo = tl.min(q_first, 0)
        t_hi = tl.max(q_last, 0)
        f_lo = tl.max(tl.where(k_ok, q_first, -1), 0)
        f_hi = tl.min(tl.where(k_ok, q_last, T), 0)
    elif MODE == 0:
        t_lo = k_first * block_stride + block_len - 1
        t_hi = T - 1
        f_lo = (k_first + BLOCK_N - 1) * block_stride + block_len - 1
        f_hi = T - 1
    elif MODE == 1:
        t_lo = k_first
        t_hi = tl.minimum(T - 1, k_last + window - 1)
        f_lo = k_first + BLOCK_N - 1
        f_hi = k_first + window - 1
    else:
        t_lo = k_first
        t_hi = T - 1
        f_lo = k_first + BLOCK_N - 1
        f_hi = T - 1
    if not PACKED:  # the keys' own ranges are read in packed mode only
        q_first = kidx
        q_last = kidx
        key_block = kidx
    # This program covers rows [split_lo, split_hi) of the (token, head) rows that see the tile.
    split_lo = pid_split * rows_per_split
    split_hi = tl.minimum((t_hi + 1) * h, split_lo + rows_per_split)
    row_start = tl.maximum(split_lo, ((t_lo * h) // BLOCK_M) * BLOCK_M)
    a, e = interior(row_start, tl.maximum(split_hi, row_start), f_lo * h, (f_hi + 1) * h - 1, BLOCK_M, True)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, row_start, a,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                q_first, q_last, key_block, True, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_M,
                                DOT_PRECISION)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, a, e,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                q_first, q_last, key_block, False, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_M,
                                DOT_PRECISION)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, e, split_hi,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                q_first, q_last, key_block, True, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_M,
                                DOT_PRECISION)
    dk_acc = dk_acc * scale
    # sdks/sdvs: each split's own slice of the outputs (deterministic mode), 0 where splits add into one.
    dk_off = pid_split.to(tl.int64) * sdks + b * sdkb + g * sdkg + kidx * sdkt
    dv_off = pid_split.to(tl.int64) * sdvs + b * sdvb + g * sdvg + kidx * sdvt
    if ATOMIC:  # several splits add into the same keys (float32, zero-initialised)
        # Relaxed: a sum needs no ordering, and Triton's default (acq_rel) fences the whole GPU around each add.
        if row_start < split_hi:
            tl.atomic_add(DKo + dk_off[:, None] + dk[None, :], dk_acc, mask=k_ok[:, None] & (dk[None, :] < DK),
                          sem="relaxed")
            tl.atomic_add(DVo + dv_off[:, None] + dv[None, :], dv_acc, mask=k_ok[:, None] & (dv[None, :] < DV),
                          sem="relaxed")
    else:
        store_tile(DKo, dk_off, dk, k_ok, dk_acc, DK)
        store_tile(DVo, dv_off, dv, k_ok, dv_acc, DV)


# ---------------------------------------------------------------- launchers


@triton.jit
def _chosen_bits_kernel(IDX, BITS, rows, n, NP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    j = tl.arange(0, NP)
    ok = (r[:, None] < rows) & (j[None, :] < n)
    idx = tl.load(IDX + r[:, None] * n + j[None, :], mask=ok, other=-1)
    one = tl.full(idx.shape, 1, tl.int64)
    # Distinct blocks per query, so the sum is the bitwise or.
    tl.store(BITS + r, tl.sum(tl.where(idx >= 0, one << tl.maximum(idx, 0), 0), axis=1), mask=r < rows)


def chosen_bits(indices: torch.Tensor, num_sel_blocks: int) -> torch.Tensor:
    """[B,T,G] int64 with bit j set where the query chose block j: MODE_SEL's form of the selection, in one kernel
    (as eager ops it would be five launches, each over the whole index)."""
    if num_sel_blocks > 64:
        raise ValueError(f"the tiled selected branch holds at most 64 selection blocks, got {num_sel_blocks}")
    flat = indices.reshape(-1, indices.shape[-1]).contiguous()
    bits = torch.empty(indices.shape[:-1], dtype=torch.int64, device=indices.device)
    block = 256 if indices.is_cuda else 16
    launcher.launch(_chosen_bits_kernel, (ceil_div(flat.shape[0], block),),
        flat, bits, flat.shape[0], flat.shape[1], NP=max(2, next_power_of_two(flat.shape[1])), BLOCK=block)
    return bits


def selection_args(bits: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(chosen bits, their three strides) as the span kernels take them: q and zero strides outside MODE_SEL."""
    if bits is None:
        return q, (0, 0, 0)
    return bits, tuple(bits.stride()[:3])


def forward(q, k, v, o, lse, mode: int, scale: float, geometry: NSAGeometry, bits: torch.Tensor | None,
            gated: tuple | None, out: torch.Tensor, layout: PackedLayout | None = None) -> None:
    """The span forward into o [B,T,H,Dv] and lse [B,T,H] (float32, -inf where nothing is visible); with
    gated = (o_cmp, o_win, gates) (MODE_SEL), also the gated sum of the three branches into out. With a layout,
    q and the keys are one packed stream (B = 1) and every document its own sequence."""
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    idx, idx_strides = selection_args(bits, q)
    o_cmp, o_win, gates = gated if gated is not None else (o, o, lse)
    gate_strides = gates.stride()[:3] if gated is not None else (0, 0, 0)
    cfg = tile_sizes(q, Dk, Dv)
    sel_block = geometry.sel_block
    tables = (layout.doc_start, layout.cmp_start) if layout is not None else (None, None)
    launcher.launch(_span_fwd_kernel, (ceil_div(T * (H // G), cfg["BLOCK_M"]), B * G),
        q, k, v, o, lse, idx, o_cmp, o_win, gates, out, *tables,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        *idx_strides, *gate_strides, T, NK, G, H // G, scale * LOG2E, geometry.block_len, geometry.block_stride,
        geometry.window, sel_block, MODE=mode, **head_dims(Dk, Dv),
        ONE_BLOCK=one_block(mode, sel_block, cfg["BLOCK_N"], layout), GATED=gated is not None,
        PACKED=layout is not None, DOT_PRECISION=dot_precision(q.dtype), **cfg,
    )


def dkdv_splits(total_rows: int, key_tiles: int, programs: int, block_m: int, device) -> tuple[int, int]:
    """(splits, rows per split) of a dK/dV kernel: a compressed or selected key tile is seen by most later
    queries, so its rows are shared by several programs (float32 atomics add their sums) to fill the GPU."""
    per_split = TUNING.cmp_rows_per_split if device.type == "cuda" else 32  # several splits in CPU tests too
    fill = ceil_div(TUNING.dkdv_programs_per_sm * num_sms(device), max(1, key_tiles * programs))
    rows_per_split = max(block_m, min(per_split, ceil_div(total_rows, fill)))
    rows_per_split = ceil_div(rows_per_split, block_m) * block_m
    return max(1, ceil_div(total_rows, rows_per_split)), rows_per_split


def dkdv(q, k, v, do, lse, delta, dk_out, dv_out, mode: int, scale: float, geometry: NSAGeometry,
         bits: torch.Tensor | None, splits: int, rows_per_split: int, layout: PackedLayout | None = None) -> None:
    """The span dK/dV kernel (tiles: tile_sizes(..., 'dkdv')). dk_out and dv_out are [parts, *k.shape]: with one
    part, splits > 1 add into it (float32, zeroed) and a single split writes it; with `splits` parts, each split
    writes its own slice. With a layout, one packed stream of documents (see forward); compressed rows that hold
    no document's token get zero.

    do is the gradient of the gated sum; lse and delta [B,T,H] are the branch's gated ones from
    gating.gate_grads (lse - ln(gate), rowsum(do * o_branch)).
    """
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    idx, idx_strides = selection_args(bits, q)
    cfg = tile_sizes(q, Dk, Dv, "dkdv")
    parts = dk_out.shape[0]
    sel_block = geometry.sel_block
    tables = ((layout.doc_start, layout.doc_end, layout.cmp_ready, layout.cmp_doc_end) if layout is not None
              else (None,) * 4)
    launcher.launch(_span_dkdv_kernel, (ceil_div(NK, cfg["BLOCK_N"]), splits, B * G),
        q, k, v, do, lse, delta, dk_out, dv_out, idx, *tables,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
        *dk_out.stride()[1:4], *dv_out.stride()[1:4], *((dk_out.stride(0), dv_out.stride(0)) if parts > 1 else (0, 0)),
        *idx_strides, T, NK, G, H // G, scale * LOG2E, scale, geometry.block_len, geometry.block_stride,
        geometry.window, sel_block, rows_per_split, MODE=mode, ATOMIC=splits > parts,
        ONE_BLOCK=one_block(mode, sel_block, cfg["BLOCK_N"], layout), PACKED=layout is not None,
        DOT_PRECISION=dot_precision(q.dtype), **head_dims(Dk, Dv), **cfg,
    )
