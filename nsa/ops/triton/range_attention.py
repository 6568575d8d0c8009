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

from .common import LOG2E, head_dims, load_grad_rows, load_tile, softmax_finish, softmax_step, store_tile
from .tuning import TUNING

MODE_CMP = 0
MODE_WIN = 1


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
def _rows(pid_m, pid_bg, T, G, h, BLOCK_M: tl.constexpr):
    """(b, g, row ok, token, head) of a program's (token, head) rows; row r <-> token r // h, head r % h."""
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return b, g, rows < T * h, (rows // h).to(tl.int64), (g * h + rows % h).to(tl.int64)


@triton.jit
def _tile_key_span(pid_m, T, h, MODE: tl.constexpr, block_len, block_stride, window, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """First (aligned to BLOCK_N) and one-past-last key any row of this tile can see."""
    t_first = (pid_m * BLOCK_M) // h
    t_last = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // h)
    lo_tile, _ = _key_range(t_first, MODE, block_len, block_stride, window)
    _, hi_tile = _key_range(t_last, MODE, block_len, block_stride, window)
    return (lo_tile // BLOCK_N) * BLOCK_N, hi_tile + 1


@triton.jit
def _range_fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sob, sot, soh, slb, slt,
    T, NK, G, h, scale_log2, block_len, block_stride, window,
    MODE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b, g, row_ok, t, head = _rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    lo, hi = _key_range(t, MODE, block_len, block_stride, window)
    k_start, k_end = _tile_key_span(pid_m, T, h, MODE, block_len, block_stride, window, BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(k_start, k_end, BLOCK_N):
        kidx = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        k_ok = (kidx >= 0) & (kidx < NK)
        k = load_tile(K, b * skb + g * skg + kidx * skt, dk, k_ok, DK)
        v = load_tile(V, b * svb + g * svg + kidx * svt, dv, k_ok, DV)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = (kidx[None, :] >= lo[:, None]) & (kidx[None, :] <= hi[:, None]) & row_ok[:, None]
        m_i, l_i, acc = softmax_step(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc)
    out, lse = softmax_finish(m_i, l_i, acc)
    store_tile(O, b * sob + t * sot + head * soh, dv, row_ok, out, DV)
    tl.store(LSE + b * slb + t * slt + head, lse, mask=row_ok)


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
    b, g, row_ok, t, head = _rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    do, lse2, delta = load_grad_rows(DO, GATE, LSE, DELTA, b * sdob + t * sdot + head * sdoh,
                                     b * sgb + t * sgt + head * sgh, b * slb + t * slt + head, dv, row_ok, DV)
    lo, hi = _key_range(t, MODE, block_len, block_stride, window)
    k_start, k_end = _tile_key_span(pid_m, T, h, MODE, block_len, block_stride, window, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    for start in range(k_start, k_end, BLOCK_N):
        kidx = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        k_ok = (kidx >= 0) & (kidx < NK)
        k = load_tile(K, b * skb + g * skg + kidx * skt, dk, k_ok, DK)
        v = load_tile(V, b * svb + g * svg + kidx * svt, dv, k_ok, DV)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = (kidx[None, :] >= lo[:, None]) & (kidx[None, :] <= hi[:, None]) & row_ok[:, None]
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    dq_off = b * sdqb + t * sdqt + head * sdqh
    if ACCUMULATE:
        dq += load_tile(DQ, dq_off, dk, row_ok, DK)
    store_tile(DQ, dq_off, dk, row_ok, dq, DK)


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
    kidx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_ok = kidx < NK
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k_off = b * skb + g * skg + kidx * skt
    v_off = b * svb + g * svg + kidx * svt
    k = load_tile(K, k_off, dk, k_ok, DK)
    v = load_tile(V, v_off, dv, k_ok, DV)
    # Queries that can see any key of this tile.
    k_first = pid_n * BLOCK_N
    k_last = tl.minimum(NK - 1, k_first + BLOCK_N - 1)
    if MODE == 0:
        t_lo = k_first * block_stride + block_len - 1
        t_hi = T - 1
    else:
        t_lo = k_first
        t_hi = tl.minimum(T - 1, k_last + window - 1)
    # This program covers rows [split_lo, split_hi) of the (token, head) rows that see the tile.
    split_lo = pid_split * rows_per_split
    split_hi = tl.minimum((t_hi + 1) * h, split_lo + rows_per_split)
    row_start = tl.maximum(split_lo, ((t_lo * h) // BLOCK_M) * BLOCK_M)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for r0 in range(row_start, split_hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < split_hi
        t = (rows // h).to(tl.int64)
        head = (g * h + rows % h).to(tl.int64)
        q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
        do, lse2, delta = load_grad_rows(DO, GATE, LSE, DELTA, b * sdob + t * sdot + head * sdoh,
                                         b * sgb + t * sgt + head * sgh, b * slb + t * slt + head, dv, row_ok, DV)
        lo, hi = _key_range(t, MODE, block_len, block_stride, window)
        visible = (kidx[:, None] >= lo[None, :]) & (kidx[:, None] <= hi[None, :]) & row_ok[None, :] & k_ok[:, None]
        st = tl.dot(k, tl.trans(q)) * scale_log2  # [BLOCK_N, BLOCK_M]
        pt = tl.where(visible, tl.exp2(st - lse2[None, :]), 0.0)
        dv_acc += tl.dot(pt.to(do.dtype), do)
        dst = pt * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk_acc += tl.dot(dst.to(q.dtype), q)
    dk_acc = dk_acc * scale
    dk_off = b * sdkb + g * sdkg + kidx * sdkt
    dv_off = b * sdvb + g * sdvg + kidx * sdvt
    if ATOMIC:  # several splits add into the same keys (float32, zero-initialised)
        if row_start < split_hi:
            tl.atomic_add(DKo + dk_off[:, None] + dk[None, :], dk_acc, mask=k_ok[:, None] & (dk[None, :] < DK))
            tl.atomic_add(DVo + dv_off[:, None] + dv[None, :], dv_acc, mask=k_ok[:, None] & (dv[None, :] < DV))
    else:
        store_tile(DKo, dk_off, dk, k_ok, dk_acc, DK)
        store_tile(DVo, dv_off, dv, k_ok, dv_acc, DV)


# ---------------------------------------------------------------- launchers


def _blocks(q: torch.Tensor, dk: int, dv: int) -> dict:
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    block_n = TUNING.range_block_n // 2 if max(dk, dv) > 64 else TUNING.range_block_n
    return dict(BLOCK_M=TUNING.range_block_m, BLOCK_N=block_n, num_warps=TUNING.range_warps,
                num_stages=TUNING.range_stages)


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
        MODE=mode, **head_dims(Dk, Dv), **cfg,
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
        *common, MODE=mode, ACCUMULATE=accumulate, **head_dims(Dk, Dv), **cfg,
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
            *common, rows_per_split, MODE=mode, ATOMIC=splits > 1, **head_dims(Dk, Dv), **cfg,
        )
    return dk_out, dv_out
