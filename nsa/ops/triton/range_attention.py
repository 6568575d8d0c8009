"""Attention where each query sees one contiguous range of keys: the compressed and window branches,
and the selected branch at short T.

Compressed (MODE_CMP): query t sees compressed tokens 0 .. floor((t - l + 1) / d).
Window (MODE_WIN): query t sees raw tokens max(0, t - w + 1) .. t.
Selected, tiled (MODE_SEL): query t sees raw tokens 0 .. t of the blocks its group chose,
given as one 64-bit mask per query (chosen_bits). Tiles walk every key up to the causal edge,
masked by the choices. That costs dense causal work, which is about what NSA does anyway while
T is a few n * l' (most of the prefix is selected), at flash-attention efficiency instead of
gathering per block; longer sequences use selected_attention's gathered kernels.

Grouped-query packing: a program's rows are consecutive (token, head) pairs of one
key/value group, row r <-> token r // h, head r % h. Any group size h fills the
matrix units without padding, and every loaded key/value tile serves all h heads.

Forward writes the branch output and its log-sum-exp; backward is split into a dK/dV
kernel here (one program per key tile, looping over the rows that see it; compressed and
selected key tiles split those rows over several programs that add with float32 atomics)
and query_grad's kernel, which walks every branch's keys for a tile of rows (the key loops
below) and writes dQ once. A one-kernel backward that adds dQ atomically from the dK/dV
kernel was measured 1.6-1.9x slower at 64k on an H100 (atomics contention).

On sm_90 GPUs the forward and the dK/dV kernel run as the Gluon kernels of hopper_forward.py and
hopper_backward.py (same contract, measured faster); the Triton kernels here serve everything else and are the
ones the CPU tests check against the reference.

Each loop runs as masked edges around an interior (keys every row of the tile sees: no range
mask; MODE_SEL still masks by the choices, one bit per row and step), three loops without
branches inside, so Triton can pipeline their loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (LOG2E, deterministic, head_dims, load_grad_rows, load_tile, num_sms, softmax_finish,
                     softmax_step, store_tile)
from .hopper_backward import hopper_backward_config, hopper_backward_supports, range_attention_dkdv_hopper
from .hopper_forward import hopper_forward_supports, range_attention_fwd_hopper
from .tuning import TUNING

MODE_CMP = 0
MODE_WIN = 1
MODE_SEL = 2


@triton.jit
def _key_range(t, MODE: tl.constexpr, block_len, block_stride, window):
    """First and last key index visible to query token(s) t (last < first means none)."""
    if MODE == 0:
        lo = t * 0
        hi = tl.where(t >= block_len - 1, tl.maximum(t - block_len + 1, 0) // block_stride, -1)
    elif MODE == 1:
        lo = tl.maximum(t - window + 1, 0)
        hi = t
    else:
        lo = t * 0
        hi = t
    return lo, hi


@triton.jit
def _chosen(BITS, off, row_ok):
    """[rows] bit j set where the row's query chose selection block j (MODE_SEL has at most 64 blocks)."""
    return tl.load(BITS + off, mask=row_ok, other=0)


@triton.jit
def _picked(bits, kidx, sel_block):
    """[rows, keys]: whether each row chose each key's block (key steps that span blocks; see _picked_rows)."""
    return ((bits[:, None] >> (kidx // sel_block)[None, :]) & 1) != 0


@triton.jit
def _picked_t(bits, kidx, sel_block):
    """_picked transposed: [keys, rows]."""
    return ((bits[None, :] >> (kidx // sel_block)[:, None]) & 1) != 0


@triton.jit
def _picked_rows(bits, first_key, sel_block):
    """[rows]: whether each row chose the block holding first_key (ONE_BLOCK: a whole key step lies in one block).

    A choice that is one bit per row is applied per row, not per element: as a +inf log-sum-exp or softmax
    maximum (p = 0), instead of a select over the tile."""
    return ((bits >> (first_key // sel_block)) & 1) != 0


@triton.jit
def _rows(pid_m, pid_bg, T, G, h, BLOCK_M: tl.constexpr):
    """(b, g, row ok, token, head) of a program's (token, head) rows; row r <-> token r // h, head r % h."""
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return b, g, rows < T * h, (rows // h).to(tl.int64), (g * h + rows % h).to(tl.int64)


@triton.jit
def _interior(first, last, lo, hi, step, ALIGN_HI: tl.constexpr):
    """Split [first, last) (first a multiple of step) at a (>= lo) and e (<= hi + 1) so that the steps of
    [a, e) lie inside [lo, hi]: [first, a) and [e, last) then need masks, [a, e) does not."""
    a = tl.minimum(tl.maximum(((lo + step - 1) // step) * step, first), last)
    e = tl.maximum(tl.minimum(((hi + 1) // step) * step, ((last // step) * step) if ALIGN_HI else last), a)
    return a, e


@triton.jit
def _key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Key indices and the K, V tiles of the key step at `start` (keys outside 0..NK-1 read 0)."""
    kidx = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_ok = (kidx >= 0) & (kidx < NK)
    return kidx, load_tile(K, k_base + kidx * skt, dk, k_ok, DK), load_tile(V, v_base + kidx * svt, dv, k_ok, DV)


@triton.jit
def _visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """[rows, keys]: each row's visible range (lo, hi int32), and for MODE_SEL its choices (unless ONE_BLOCK).

    The compressed range starts at key 0, so one compare (rows past the end get an empty range). The window's
    two bounds as one unsigned compare of hi - key saved instructions but cost registers: the dQ kernel went from
    128 to 150 (sm_90; 3 programs per SM instead of 4) and the tiled selected forward spilled."""
    k32 = kidx.to(tl.int32)  # 32-bit compares: key indices stay below T
    if MODE == 0:
        visible = k32[None, :] <= tl.where(row_ok, hi, -1)[:, None]
    else:
        visible = (k32[None, :] >= lo[:, None]) & (k32[None, :] <= hi[:, None]) & row_ok[:, None]
    if MODE == 2 and not ONE_BLOCK:  # ONE_BLOCK: the callers apply the choice per row
        visible = visible & _picked(chosen, kidx, sel_block)
    return visible


@triton.jit
def _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, first, last, lo, hi, row_ok, chosen, sel_block, dk, dv,
              scale_log2, m_i, l_i, acc, MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key steps [first, last); MASKED applies each row's visible range (and choice)."""
    for start in range(first, last, BLOCK_N):
        kidx, k, v = _key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k))  # raw: softmax_step scales
        pick = _picked_rows(chosen, start, sel_block) if MODE == 2 and ONE_BLOCK else row_ok
        if MASKED:
            visible = _visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE, ONE_BLOCK)
            s = tl.where(visible, s, float("-inf"))
        elif MODE == 2 and not ONE_BLOCK:
            s = tl.where(_picked(chosen, kidx, sel_block), s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, scale_log2, pick, MODE == 2 and ONE_BLOCK)
    return m_i, l_i, acc


@triton.jit
def _key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE: tl.constexpr, block_len, block_stride, window,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For a tile of query rows: each row's key range, the tile's key steps [k_start, k_end), the rows' choices
    (MODE_SEL), and the interior [a, e) of keys every row sees (MODE_SEL masks it by the choices alone)."""
    lo, hi = _key_range(t.to(tl.int32), MODE, block_len, block_stride, window)
    t_first = (pid_m * BLOCK_M) // h
    t_last = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // h)
    # Keys any row sees: from the first token's first to the last token's last (the start aligned to BLOCK_N).
    span_lo, full_hi = _key_range(t_first, MODE, block_len, block_stride, window)
    full_lo, span_hi = _key_range(t_last, MODE, block_len, block_stride, window)
    k_start = (span_lo // BLOCK_N) * BLOCK_N
    k_end = span_hi + 1
    if MODE == 2:
        chosen = _chosen(IDX, b * sib + t * sit + g * sig, row_ok)
    else:
        chosen = row_ok.to(tl.int64)
    a, e = _interior(k_start, k_end, full_lo, full_hi, BLOCK_N, False)
    return lo, hi, k_start, k_end, chosen, a, e


@triton.jit
def _range_fwd_kernel(
    Q, K, V, O, LSE, IDX, O_CMP, O_WIN, GATES, OUT,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sob, sot, soh, slb, slt, sib, sit, sig, sgb, sgt, sgh,
    T, NK, G, h: tl.constexpr, scale_log2, block_len, block_stride, window, sel_block,
    MODE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, GATED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b, g, row_ok, t, head = _rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    lo, hi, k_start, k_end, chosen, a, e = _key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE,
                                                     block_len, block_stride, window, BLOCK_M, BLOCK_N)
    k_base = b * skb + g * skg
    v_base = b * svb + g * svg
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, k_start, a, lo, hi, row_ok, chosen, sel_block,
                              dk, dv, scale_log2, m_i, l_i, acc, True, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, a, e, lo, hi, row_ok, chosen, sel_block,
                              dk, dv, scale_log2, m_i, l_i, acc, False, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
    m_i, l_i, acc = _fwd_keys(q, K, V, k_base, v_base, skt, svt, NK, e, k_end, lo, hi, row_ok, chosen, sel_block,
                              dk, dv, scale_log2, m_i, l_i, acc, True, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
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
def _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, first, last, lo, hi, row_ok, chosen, sel_block,
             dk, dv, scale_log2, dq, MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    for start in range(first, last, BLOCK_N):
        kidx, k, v = _key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK, DV, BLOCK_N)
        if MODE == 2 and ONE_BLOCK:
            p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 -
                        tl.where(_picked_rows(chosen, start, sel_block), lse2, float("inf"))[:, None])
        else:
            p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse2[:, None])
        if MASKED:
            visible = _visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE, ONE_BLOCK)
            p = tl.where(visible, p, 0.0)
        elif MODE == 2 and not ONE_BLOCK:
            p = tl.where(_picked(chosen, kidx, sel_block), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _sees(kidx, k_ok, t, row_ok, MODE: tl.constexpr, block_len, block_stride, window):
    """[keys, rows]: whether query token t sees key kidx (int32 both), false for keys or rows out of range. One
    compare per element (the ranges folded per key and per row); written per key, never dividing per row: an
    int64 division by a runtime stride is a ~100-instruction subroutine call on the GPU."""
    if MODE == 0:
        last = tl.where(k_ok, kidx * block_stride + block_len - 1, 2147483647)  # the first query that sees it
        return last[:, None] <= tl.where(row_ok, t, -1)[None, :]
    elif MODE == 1:  # 0 <= t - key < window, unsigned (keys past the end have key > t; rows past it, t = -2^30)
        return (tl.where(row_ok, t, -1073741824)[None, :] - kidx[:, None]).to(tl.uint32) < window.to(tl.uint32)
    else:  # keys past the end have key > t
        return kidx[:, None] <= tl.where(row_ok, t, -1)[None, :]


@triton.jit
def _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h: tl.constexpr, first, last, split_hi,
               sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
               block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
               MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """dK/dV of one key tile over (token, head) row steps [first, last)."""
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
            bits = _chosen(IDX, b * sib + t * sit + g * sig, row_ok)
            if ONE_BLOCK:
                lse2 = tl.where(_picked_rows(bits, k_first, sel_block), lse2, float("inf"))
        pt = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            visible = _sees(kidx32, k_ok, t32, row_ok, MODE, block_len, block_stride, window)
            if MODE == 2 and not ONE_BLOCK:
                visible = visible & _picked_t(bits, kidx, sel_block)
            pt = tl.where(visible, pt, 0.0)
        elif MODE == 2 and not ONE_BLOCK:
            pt = tl.where(_picked_t(bits, kidx, sel_block), pt, 0.0)
        dv_acc += tl.dot(pt.to(do.dtype), do)
        dst = pt * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk_acc += tl.dot(dst.to(q.dtype), q)
    return dk_acc, dv_acc


@triton.jit
def _range_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DKo, DVo, IDX,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, slb, slt,
    sdkb, sdkt, sdkg, sdvb, sdvt, sdvg, sdks, sdvs, sib, sit, sig,
    T, NK, G, h: tl.constexpr, scale_log2, scale, block_len, block_stride, window, sel_block, rows_per_split,
    MODE: tl.constexpr, ATOMIC: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
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
    if MODE == 0:
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
    # This program covers rows [split_lo, split_hi) of the (token, head) rows that see the tile.
    split_lo = pid_split * rows_per_split
    split_hi = tl.minimum((t_hi + 1) * h, split_lo + rows_per_split)
    row_start = tl.maximum(split_lo, ((t_lo * h) // BLOCK_M) * BLOCK_M)
    a, e = _interior(row_start, tl.maximum(split_hi, row_start), f_lo * h, (f_hi + 1) * h - 1, BLOCK_M, True)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, row_start, a,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                True, MODE, ONE_BLOCK, DK, DV, BLOCK_M)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, a, e,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                False, MODE, ONE_BLOCK, DK, DV, BLOCK_M)
    dk_acc, dv_acc = _dkdv_rows(k, v, kidx, k_ok, k_first, Q, DO, LSE, DELTA, IDX, b, g, h, e, split_hi,
                                split_hi, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sib, sit, sig,
                                block_len, block_stride, window, sel_block, dk, dv, scale_log2, dk_acc, dv_acc,
                                True, MODE, ONE_BLOCK, DK, DV, BLOCK_M)
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


def _blocks(q: torch.Tensor, dk: int, dv: int, kernel: str = "fwd") -> dict:
    """Tile sizes of the forward, dQ or dK/dV kernel (query rows x key step; dK/dV: row step x keys)."""
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    wide = max(dk, dv) > 64
    if kernel == "dkdv":
        return dict(BLOCK_M=TUNING.dkdv_block_m_wide if wide else TUNING.dkdv_block_m, BLOCK_N=TUNING.dkdv_block_n,
                    num_warps=TUNING.dkdv_warps, num_stages=TUNING.dkdv_stages)
    if kernel == "dq" and not wide:
        return dict(BLOCK_M=TUNING.dq_block_m, BLOCK_N=TUNING.dq_block_n, num_warps=TUNING.dq_warps,
                    num_stages=TUNING.range_stages)
    return dict(BLOCK_M=TUNING.range_block_m_wide if wide else TUNING.range_block_m, BLOCK_N=TUNING.range_block_n,
                num_warps=TUNING.range_warps, num_stages=TUNING.range_stages)


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
    """[B,T,G] int64 with bit j set where the query chose block j: MODE_SEL's form of the selection.

    One kernel: as five eager ops (compare, clamp, shift, select, sum) it took ~1.3 ms of an M7C training step at
    2k x 32 on an H100, forward and backward."""
    if num_sel_blocks > 64:
        raise ValueError(f"the tiled selected branch holds at most 64 selection blocks, got {num_sel_blocks}")
    flat = indices.reshape(-1, indices.shape[-1]).contiguous()
    bits = torch.empty(indices.shape[:-1], dtype=torch.int64, device=indices.device)
    block = 256 if indices.is_cuda else 16
    _chosen_bits_kernel[(triton.cdiv(flat.shape[0], block),)](
        flat, bits, flat.shape[0], flat.shape[1], NP=max(2, triton.next_power_of_2(flat.shape[1])), BLOCK=block)
    return bits


def _selection_args(bits: torch.Tensor | None, q: torch.Tensor, sel_block: int) -> tuple[torch.Tensor, tuple, int]:
    """(chosen bits, their three strides, sel_block) for the kernels; dummies outside MODE_SEL."""
    if bits is None:
        return q, (0, 0, 0), max(sel_block, 1)
    return bits, tuple(bits.stride()[:3]), sel_block


def range_attention_fwd(q, k, v, mode: int, scale: float, block_len: int, block_stride: int, window: int,
                        bits: torch.Tensor | None = None, sel_block: int = 0, gated: tuple | None = None):
    """Branch output [B,T,H,Dv] (q's dtype) and log-sum-exp [B,T,H] (float32, -inf where nothing is visible).

    MODE_SEL needs the selection as chosen_bits(indices, ...) and the block size `sel_block`. With
    gated = (o_cmp, o_win, gates) (MODE_SEL), the gated sum of the three branches comes third.
    """
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    h = H // G
    o = torch.empty(B, T, H, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    idx, idx_strides, sel = _selection_args(bits, q, sel_block)
    o_cmp, o_win, gates = gated if gated is not None else (o, o, lse)
    out = torch.empty_like(o) if gated is not None else o
    gate_strides = gates.stride()[:3] if gated is not None else (0, 0, 0)
    if hopper_forward_supports(q, k, v, mode, sel):
        range_attention_fwd_hopper(q, k, v, o, lse, mode, scale, block_len, block_stride, window, idx,
                                   idx_strides, sel, gated, out)
        return (o, lse, out) if gated is not None else (o, lse)
    cfg = _blocks(q, Dk, Dv)
    grid = (triton.cdiv(T * h, cfg["BLOCK_M"]), B * G)
    _range_fwd_kernel[grid](
        q, k, v, o, lse, idx, o_cmp, o_win, gates, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        *idx_strides, *gate_strides, T, NK, G, h, scale * LOG2E, block_len, block_stride, window, sel,
        MODE=mode, **head_dims(Dk, Dv), ONE_BLOCK=sel % cfg["BLOCK_N"] == 0, GATED=gated is not None, **cfg,
    )
    return (o, lse, out) if gated is not None else (o, lse)


def _dkdv_splits(total_rows: int, key_tiles: int, programs: int, block_m: int, device) -> tuple[int, int]:
    """(splits, rows per split) of the dK/dV kernel: a compressed or selected key tile is seen by most later
    queries, so its rows are shared by several programs (float32 atomics add their sums) to fill the GPU."""
    per_split = TUNING.cmp_rows_per_split if device.type == "cuda" else 32  # several splits in CPU tests too
    fill = triton.cdiv(TUNING.dkdv_programs_per_sm * num_sms(device), max(1, key_tiles * programs))
    rows_per_split = max(block_m, min(per_split, triton.cdiv(total_rows, fill)))
    rows_per_split = triton.cdiv(rows_per_split, block_m) * block_m
    return max(1, triton.cdiv(total_rows, rows_per_split)), rows_per_split


def range_attention_dkdv(q, k, v, do, lse, delta, mode: int, scale: float, block_len: int, block_stride: int,
                         window: int, bits: torch.Tensor | None = None, sel_block: int = 0):
    """(dK, dV) of one branch (its dQ is query_grad's): float32 where programs split the rows (atomic sums, or in
    deterministic mode partial sums added in a fixed order), else in k's type.

    do is the gradient of the gated sum; lse and delta [B,T,H] are the branch's gated ones from
    gating.gate_grads (lse - ln(gate), rowsum(do * o_branch)).
    """
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    h = H // G
    idx, idx_strides, sel = _selection_args(bits, q, sel_block)
    common = (T, NK, G, h, scale * LOG2E, scale, block_len, block_stride, window, sel)
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
    )
    dims = dict(MODE=mode, **head_dims(Dk, Dv))
    hopper = hopper_backward_supports(q, k, v, do, mode, sel)
    cfg = hopper_backward_config(Dk) if hopper else _blocks(q, Dk, Dv, "dkdv")
    key_tiles = triton.cdiv(NK, cfg["BLOCK_N"])
    if mode == MODE_WIN:
        splits, rows_per_split = 1, T * h
    else:
        splits, rows_per_split = _dkdv_splits(T * h, key_tiles, B * G, cfg["BLOCK_M"], q.device)
    # Several splits: float32 atomic sums into one zeroed buffer, or in deterministic mode each split's partial in
    # its own slice (every program writes its slice), summed afterwards in split order. One split: a tile stored
    # once, rounded to the inputs' type in the kernel (saving the conversion pass a float32 result would need).
    parts = splits if splits > 1 and deterministic() else 1
    alloc = torch.zeros if splits > parts else torch.empty
    dtype = torch.float32 if splits > 1 else k.dtype
    dk_out = alloc((parts, *k.shape), device=k.device, dtype=dtype)
    dv_out = alloc((parts, *v.shape), device=v.device, dtype=dtype)
    if NK > 0 and hopper:
        range_attention_dkdv_hopper(q, k, v, do, lse, delta, dk_out, dv_out, mode, scale, block_len, block_stride,
                                    window, idx, idx_strides, sel, splits, rows_per_split)
    elif NK > 0:
        _range_bwd_dkdv_kernel[(key_tiles, splits, B * G)](
            q, k, v, do, lse, delta, dk_out, dv_out, idx, *strides,
            *dk_out.stride()[1:4], *dv_out.stride()[1:4], *_split_strides(dk_out, dv_out),
            *idx_strides, *common, rows_per_split, ATOMIC=splits > parts,
            ONE_BLOCK=sel % cfg["BLOCK_N"] == 0, **dims, **cfg,
        )
    return (dk_out.sum(0), dv_out.sum(0)) if parts > 1 else (dk_out[0], dv_out[0])


def _split_strides(dk_out: torch.Tensor, dv_out: torch.Tensor) -> tuple[int, int]:
    """Stride between splits' slices of the [splits, *k.shape] outputs: 0 where they share one slice."""
    return tuple(t.stride(0) if t.shape[0] > 1 else 0 for t in (dk_out, dv_out))
