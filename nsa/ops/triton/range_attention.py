"""Attention where each query sees one contiguous range of keys: the compressed and window branches.

Compressed (MODE_CMP): query t sees compressed tokens 0 .. floor((t - l + 1) / d).
Window (MODE_WIN): query t sees raw tokens max(0, t - w + 1) .. t.

Grouped-query packing: a program's rows are consecutive (token, head) pairs of one
key/value group, row r <-> token r // h, head r % h. Any group size h fills the
matrix units without padding, and every loaded key/value tile serves all h heads.

Forward writes the branch output and its log-sum-exp; backward is split into a dQ
kernel (one program per row tile) and a dK/dV kernel (one program per key tile,
looping over the rows that see it), so no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import TUNING

MODE_CMP = 0
MODE_WIN = 1
LOG2E = 1.4426950408889634


@triton.jit
def _key_range(t, MODE: tl.constexpr, block_len, block_stride, window):
    """First and last key index visible to query token(s) t (last < first means none)."""
    if MODE == 0:
        lo = t * 0
        hi = tl.where(t >= block_len - 1, tl.maximum(t - block_len + 1, 0) // block_stride, -1)
    else:
        lo = tl.maximum(t - window + 1, 0)
        hi = t
    return lo, hi


@triton.jit
def _range_fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sob, sot, soh, slb, slt,
    T, NK, G, h, scale_log2, block_len, block_stride, window,
    MODE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * h
    t = rows // h
    head = (g * h + rows % h).to(tl.int64)
    t64 = t.to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + t64[:, None] * sqt + head[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    lo, hi = _key_range(t, MODE, block_len, block_stride, window)
    t_first = (pid_m * BLOCK_M) // h
    t_last = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // h)
    lo_tile, _ = _key_range(t_first, MODE, block_len, block_stride, window)
    _, hi_tile = _key_range(t_last, MODE, block_len, block_stride, window)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kbase = K + b * skb + g * skg
    vbase = V + b * svb + g * svg
    for start in range((lo_tile // BLOCK_N) * BLOCK_N, hi_tile + 1, BLOCK_N):
        kidx = start + tl.arange(0, BLOCK_N)
        k_ok = (kidx >= 0) & (kidx < NK)
        k = tl.load(kbase + kidx.to(tl.int64)[:, None] * skt + dk[None, :],
                    mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(vbase + kidx.to(tl.int64)[:, None] * svt + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = (kidx[None, :] >= lo[:, None]) & (kidx[None, :] <= hi[:, None]) & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + t64[:, None] * sot + head[:, None] * soh + dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + b * slb + t64 * slt + head, lse, mask=row_ok)


@triton.jit
def _range_bwd_dq_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DQ,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, sgb, sgt, sgh, slb, slt,
    sdqb, sdqt, sdqh,
    T, NK, G, h, scale_log2, scale, block_len, block_stride, window,
    MODE: tl.constexpr, ACCUMULATE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * h
    t = rows // h
    head = (g * h + rows % h).to(tl.int64)
    t64 = t.to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + t64[:, None] * sqt + head[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    gate = tl.load(GATE + b * sgb + t64 * sgt + head * sgh, mask=row_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdob + t64[:, None] * sdot + head[:, None] * sdoh + dv[None, :],
                 mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    do = (do.to(tl.float32) * gate[:, None]).to(do.dtype)
    lse2 = tl.load(LSE + b * slb + t64 * slt + head, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + b * slb + t64 * slt + head, mask=row_ok, other=0.0)
    lo, hi = _key_range(t, MODE, block_len, block_stride, window)
    t_first = (pid_m * BLOCK_M) // h
    t_last = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // h)
    lo_tile, _ = _key_range(t_first, MODE, block_len, block_stride, window)
    _, hi_tile = _key_range(t_last, MODE, block_len, block_stride, window)

    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    kbase = K + b * skb + g * skg
    vbase = V + b * svb + g * svg
    for start in range((lo_tile // BLOCK_N) * BLOCK_N, hi_tile + 1, BLOCK_N):
        kidx = start + tl.arange(0, BLOCK_N)
        k_ok = (kidx >= 0) & (kidx < NK)
        k = tl.load(kbase + kidx.to(tl.int64)[:, None] * skt + dk[None, :],
                    mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(vbase + kidx.to(tl.int64)[:, None] * svt + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = (kidx[None, :] >= lo[:, None]) & (kidx[None, :] <= hi[:, None]) & row_ok[:, None]
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    dq_ptrs = DQ + b * sdqb + t64[:, None] * sdqt + head[:, None] * sdqh + dk[None, :]
    dq_mask = row_ok[:, None] & (dk[None, :] < DK)
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=dq_mask, other=0.0)
    tl.store(dq_ptrs, dq, mask=dq_mask)


@triton.jit
def _range_bwd_dkdv_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DKo, DVo,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, sgb, sgt, sgh, slb, slt,
    sdkb, sdkt, sdkg, sdvb, sdvt, sdvg,
    T, NK, G, h, scale_log2, scale, block_len, block_stride, window, rows_per_split,
    MODE: tl.constexpr, ATOMIC: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_split = tl.program_id(1)
    pid_bg = tl.program_id(2)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    kidx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kidx < NK
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * skb + g * skg + kidx.to(tl.int64)[:, None] * skt + dk[None, :],
                mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + g * svg + kidx.to(tl.int64)[:, None] * svt + dv[None, :],
                mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
    # Queries that can see any key of this tile.
    k_first = pid_n * BLOCK_N
    k_last = tl.minimum(NK - 1, k_first + BLOCK_N - 1)
    if MODE == 0:
        t_lo = k_first * block_stride + block_len - 1
        t_hi = T - 1
    else:
        t_lo = k_first
        t_hi = tl.minimum(T - 1, k_last + window - 1)

    dk_acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # This program covers rows [split_lo, split_hi) of the (token, head) rows that see the tile.
    split_lo = pid_split * rows_per_split
    split_hi = tl.minimum((t_hi + 1) * h, split_lo + rows_per_split)
    row_start = tl.maximum(split_lo, ((t_lo * h) // BLOCK_M) * BLOCK_M)
    for r0 in range(row_start, split_hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < split_hi
        t = rows // h
        head = (g * h + rows % h).to(tl.int64)
        t64 = t.to(tl.int64)
        q = tl.load(Q + b * sqb + t64[:, None] * sqt + head[:, None] * sqh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        gate = tl.load(GATE + b * sgb + t64 * sgt + head * sgh, mask=row_ok, other=0.0).to(tl.float32)
        do = tl.load(DO + b * sdob + t64[:, None] * sdot + head[:, None] * sdoh + dv[None, :],
                     mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
        do = (do.to(tl.float32) * gate[:, None]).to(do.dtype)
        lse2 = tl.load(LSE + b * slb + t64 * slt + head, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + b * slb + t64 * slt + head, mask=row_ok, other=0.0)
        lo, hi = _key_range(t, MODE, block_len, block_stride, window)
        visible = (kidx[:, None] >= lo[None, :]) & (kidx[:, None] <= hi[None, :]) & row_ok[None, :] & k_ok[:, None]
        st = tl.dot(k, tl.trans(q)) * scale_log2  # [BLOCK_N, BLOCK_M]
        pt = tl.where(visible, tl.exp2(st - lse2[None, :]), 0.0)
        dv_acc += tl.dot(pt.to(do.dtype), do)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk_acc += tl.dot(dst.to(q.dtype), q)
    dk_acc = dk_acc * scale
    dk_ptrs = DKo + b * sdkb + g * sdkg + kidx.to(tl.int64)[:, None] * sdkt + dk[None, :]
    dv_ptrs = DVo + b * sdvb + g * sdvg + kidx.to(tl.int64)[:, None] * sdvt + dv[None, :]
    dk_mask = k_ok[:, None] & (dk[None, :] < DK)
    dv_mask = k_ok[:, None] & (dv[None, :] < DV)
    if ATOMIC:  # several splits add into the same keys (float32, zero-initialised)
        if row_start < split_hi:
            tl.atomic_add(dk_ptrs, dk_acc, mask=dk_mask)
            tl.atomic_add(dv_ptrs, dv_acc, mask=dv_mask)
    else:
        tl.store(dk_ptrs, dk_acc.to(DKo.dtype.element_ty), mask=dk_mask)
        tl.store(dv_ptrs, dv_acc.to(DVo.dtype.element_ty), mask=dv_mask)


# ---------------------------------------------------------------- launchers


def _blocks(q: torch.Tensor, dk: int, dv: int) -> dict:
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    block_n = TUNING.range_block_n // 2 if max(dk, dv) > 64 else TUNING.range_block_n
    return dict(BLOCK_M=TUNING.range_block_m, BLOCK_N=block_n, num_warps=TUNING.range_warps,
                num_stages=TUNING.range_stages)


def _dims(dk: int, dv: int) -> dict:
    return dict(DK=dk, DV=dv, BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))


def range_attention_fwd(q, k, v, mode: int, scale: float, block_len: int, block_stride: int, window: int):
    """Branch output [B,T,H,Dv] (q's dtype) and log-sum-exp [B,T,H] (float32, -inf where nothing is visible)."""
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    h = H // G
    o = torch.empty(B, T, H, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    cfg = _blocks(q, Dk, Dv)
    grid = (triton.cdiv(T * h, cfg["BLOCK_M"]), B * G)
    _range_fwd_kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        T, NK, G, h, scale * LOG2E, block_len, block_stride, window,
        MODE=mode, **_dims(Dk, Dv), **cfg,
    )
    return o, lse


def range_attention_bwd(q, k, v, do, gate, lse, delta, dq, mode: int, accumulate: bool, scale: float,
                        block_len: int, block_stride: int, window: int):
    """Adds this branch's dQ into dq (float32) and returns (dK, dV) in float32.

    do is the gradient of the gated sum; gate [B,T,H] scales it to this branch's share.
    delta [B,T,H] = rowsum(gate * do * o_branch).
    """
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    h = H // G
    cfg = _blocks(q, Dk, Dv)
    common = (T, NK, G, h, scale * LOG2E, scale, block_len, block_stride, window)
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        gate.stride(0), gate.stride(1), gate.stride(2), lse.stride(0), lse.stride(1),
    )
    _range_bwd_dq_kernel[(triton.cdiv(T * h, cfg["BLOCK_M"]), B * G)](
        q, k, v, do, gate, lse, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        *common, MODE=mode, ACCUMULATE=accumulate, **_dims(Dk, Dv), **cfg,
    )
    # A compressed key is seen by every later query: split those rows over several programs
    # (float32 atomics add their partial sums) so that the few key tiles still fill the GPU.
    total_rows = T * h
    per_split = TUNING.cmp_rows_per_split if q.device.type == "cuda" else 32  # several splits in CPU tests too
    rows_per_split = total_rows if mode == MODE_WIN else max(cfg["BLOCK_M"], per_split)
    rows_per_split = triton.cdiv(rows_per_split, cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    splits = max(1, triton.cdiv(total_rows, rows_per_split))
    alloc = torch.zeros if splits > 1 else torch.empty
    dk_out = alloc(k.shape, device=k.device, dtype=torch.float32)
    dv_out = alloc(v.shape, device=v.device, dtype=torch.float32)
    if NK > 0:
        _range_bwd_dkdv_kernel[(triton.cdiv(NK, cfg["BLOCK_N"]), splits, B * G)](
            q, k, v, do, gate, lse, delta, dk_out, dv_out, *strides,
            dk_out.stride(0), dk_out.stride(1), dk_out.stride(2), dv_out.stride(0), dv_out.stride(1), dv_out.stride(2),
            *common, rows_per_split, MODE=mode, ATOMIC=splits > 1, **_dims(Dk, Dv), **cfg,
        )
    return dk_out, dv_out
