"""The selected branch: each query attends to the tokens (s <= t) of its group's n selected blocks.

Forward and dQ: one program per (token, group); its h heads share the gathered key
blocks (rows padded to HP >= 16 for the matrix units).

dK/dV: the other direction. An inverse index lists, for every (batch, group, block),
the queries that selected it (CSR, built with one device sort, no host sync). Work
items of at most CHUNK such queries each load their block's keys/values once and
loop over the queries' (token, head) rows, so a block's gradient is accumulated in
registers; items of one block add their partial sums with one float32 atomic per
element (only blocks chosen by more than CHUNK queries, e.g. the forced block 0,
have several items; see Tuning.inverse_chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .range_attention import LOG2E
from .tuning import TUNING


@triton.jit
def _sel_fwd_kernel(
    Q, K, V, IDX, O, LSE,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sib, sit, sig, sob, sot, soh, slb, slt,
    T, G, h, scale_log2, sel_block, n_sel,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    t64 = t.to(tl.int64)
    r = tl.arange(0, HP)
    row_ok = r < h
    head = (g * h + tl.where(row_ok, r, 0)).to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + t64 * sqt + head[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    kbase = K + b * skb + g * skg
    vbase = V + b * svb + g * svg
    lk = tl.arange(0, BLOCK_L)
    for slot in range(n_sel):
        j = tl.load(IDX + b * sib + t64 * sit + g * sig + slot)
        kidx = j * sel_block + lk
        k_ok = (j >= 0) & (lk < sel_block) & (kidx <= t)
        k = tl.load(kbase + kidx[:, None] * skt + dk[None, :], mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(vbase + kidx[:, None] * svt + dv[None, :], mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]  # the current block is always selected: l_i > 0
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634
    tl.store(O + b * sob + t64 * sot + head[:, None] * soh + dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + b * slb + t64 * slt + head, lse, mask=row_ok)


@triton.jit
def _sel_bwd_dq_kernel(
    Q, K, V, IDX, DO, GATE, LSE, DELTA, DQ,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sib, sit, sig, sdob, sdot, sdoh, sgb, sgt, sgh, slb, slt,
    sdqb, sdqt, sdqh,
    T, G, h, scale_log2, scale, sel_block, n_sel,
    ACCUMULATE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, HP: tl.constexpr, BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    t64 = t.to(tl.int64)
    r = tl.arange(0, HP)
    row_ok = r < h
    head = (g * h + tl.where(row_ok, r, 0)).to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + t64 * sqt + head[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    gate = tl.load(GATE + b * sgb + t64 * sgt + head * sgh, mask=row_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdob + t64 * sdot + head[:, None] * sdoh + dv[None, :],
                 mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
    do = (do.to(tl.float32) * gate[:, None]).to(do.dtype)
    lse2 = tl.load(LSE + b * slb + t64 * slt + head, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + b * slb + t64 * slt + head, mask=row_ok, other=0.0)
    dq = tl.zeros([HP, BLOCK_DK], tl.float32)
    kbase = K + b * skb + g * skg
    vbase = V + b * svb + g * svg
    lk = tl.arange(0, BLOCK_L)
    for slot in range(n_sel):
        j = tl.load(IDX + b * sib + t64 * sit + g * sig + slot)
        kidx = j * sel_block + lk
        k_ok = (j >= 0) & (lk < sel_block) & (kidx <= t)
        k = tl.load(kbase + kidx[:, None] * skt + dk[None, :], mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(vbase + kidx[:, None] * svt + dv[None, :], mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        p = tl.where(k_ok[None, :] & row_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    dq_ptrs = DQ + b * sdqb + t64 * sdqt + head[:, None] * sdqh + dk[None, :]
    dq_mask = row_ok[:, None] & (dk[None, :] < DK)
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=dq_mask, other=0.0)
    tl.store(dq_ptrs, dq, mask=dq_mask)


@triton.jit
def _sel_bwd_dkdv_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DKo, DVo,
    ITEM_KEY, ITEM_START, ITEM_COUNT, TOKENS,
    sqb, sqt, sqh, skb, skt, skg, svb, svt, svg, sdob, sdot, sdoh, sgb, sgt, sgh, slb, slt,
    sdkb, sdkt, sdkg, sdvb, sdvt, sdvg,
    T, G, NS, h, scale_log2, scale, sel_block,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    item = tl.program_id(0)
    count = tl.load(ITEM_COUNT + item)
    if count > 0:
        key = tl.load(ITEM_KEY + item)  # (b * G + g) * NS + j
        start = tl.load(ITEM_START + item)
        j = key % NS
        bg = key // NS
        b = (bg // G).to(tl.int64)
        g = bg % G
        lk = tl.arange(0, BLOCK_L)
        kidx = (j * sel_block + lk).to(tl.int64)
        k_ok = (lk < sel_block) & (kidx < T)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        k = tl.load(K + b * skb + g * skg + kidx[:, None] * skt + dk[None, :],
                    mask=k_ok[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + g * svg + kidx[:, None] * svt + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        dk_acc = tl.zeros([BLOCK_L, BLOCK_DK], tl.float32)
        dv_acc = tl.zeros([BLOCK_L, BLOCK_DV], tl.float32)
        # Rows are (query, head) pairs of this item's queries, query-major.
        for r0 in range(0, count * h, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < count * h
            t = tl.load(TOKENS + start + rows // h, mask=row_ok, other=0)
            t64 = t.to(tl.int64)
            head = (g * h + rows % h).to(tl.int64)
            q = tl.load(Q + b * sqb + t64[:, None] * sqt + head[:, None] * sqh + dk[None, :],
                        mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
            gate = tl.load(GATE + b * sgb + t64 * sgt + head * sgh, mask=row_ok, other=0.0).to(tl.float32)
            do = tl.load(DO + b * sdob + t64[:, None] * sdot + head[:, None] * sdoh + dv[None, :],
                         mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
            do = (do.to(tl.float32) * gate[:, None]).to(do.dtype)
            lse2 = tl.load(LSE + b * slb + t64 * slt + head, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + b * slb + t64 * slt + head, mask=row_ok, other=0.0)
            visible = k_ok[:, None] & row_ok[None, :] & (kidx[:, None] <= t64[None, :])
            st = tl.dot(k, tl.trans(q)) * scale_log2
            pt = tl.where(visible, tl.exp2(st - lse2[None, :]), 0.0)
            dv_acc += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk_acc += tl.dot(dst.to(q.dtype), q)
        dk_acc = dk_acc * scale
        tl.atomic_add(DKo + b * sdkb + g * sdkg + kidx[:, None] * sdkt + dk[None, :], dk_acc,
                      mask=k_ok[:, None] & (dk[None, :] < DK))
        tl.atomic_add(DVo + b * sdvb + g * sdvg + kidx[:, None] * sdvt + dv[None, :], dv_acc,
                      mask=k_ok[:, None] & (dv[None, :] < DV))


# ---------------------------------------------------------------- launchers


def _dims(dk: int, dv: int) -> dict:
    return dict(DK=dk, DV=dv, BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))


def _row_pad(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def _launch(q: torch.Tensor) -> dict:
    if q.device.type != "cuda":
        return dict(num_warps=1)
    return dict(num_warps=TUNING.sel_warps, num_stages=TUNING.sel_stages)


def selected_attention_fwd(q, k, v, indices, scale: float, sel_block: int):
    """Branch output [B,T,H,Dv] and its log-sum-exp [B,T,H] (float32)."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    o = torch.empty(B, T, H, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    _sel_fwd_kernel[(T, B * G)](
        q, k, v, indices, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), indices.stride(0), indices.stride(1), indices.stride(2), o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        T, G, H // G, scale * LOG2E, sel_block, indices.shape[-1],
        **_dims(Dk, Dv), HP=_row_pad(H // G), BLOCK_L=max(16, triton.next_power_of_2(sel_block)),
        **_launch(q),
    )
    return o, lse


def inverse_index(indices: torch.Tensor, num_sel_blocks: int, chunk: int):
    """For every (b, g, block): the queries that selected it, as work items of at most `chunk` queries.

    Returns (item_key, item_start, item_count, tokens): item i covers tokens[item_start[i] :
    item_start[i] + item_count[i]] for key (b * G + g) * Ns + j. The number of items is a
    bound known on the host (no sync); unused items have count 0.
    """
    B, T, G, n = indices.shape
    n_keys = B * G * num_sel_blocks
    dev = indices.device
    by_group = indices.permute(0, 2, 1, 3)  # [B,G,T,n]: flattening keeps t ascending within a key
    bg = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    keys = torch.where(by_group >= 0, bg * num_sel_blocks + by_group, n_keys).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    tokens = (order // n % T).to(torch.int32)
    counts = torch.bincount(sorted_keys, minlength=n_keys + 1)[:n_keys]
    starts = torch.cumsum(counts, 0) - counts
    items_per_key = (counts + chunk - 1) // chunk
    item_end = torch.cumsum(items_per_key, 0)
    max_items = (B * T * G * n) // chunk + n_keys
    item = torch.arange(max_items, device=dev)
    item_key = torch.searchsorted(item_end, item, right=True).clamp_max(n_keys - 1)
    within = item - (item_end[item_key] - items_per_key[item_key])
    item_count = (counts[item_key] - within * chunk).clamp(0, chunk)
    item_count = torch.where(item < item_end[-1], item_count, 0)
    item_start = starts[item_key] + within * chunk
    return item_key.to(torch.int32), item_start.to(torch.int32), item_count.to(torch.int32), tokens


def selected_attention_bwd(q, k, v, indices, do, gate, lse, delta, dq, accumulate: bool, scale: float,
                           sel_block: int, chunk: int | None = None):
    """Adds this branch's dQ into dq (float32); returns (dK, dV) in float32."""
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    h = H // G
    n_sel = indices.shape[-1]
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
    )
    grad_strides = (
        do.stride(0), do.stride(1), do.stride(2), gate.stride(0), gate.stride(1), gate.stride(2),
        lse.stride(0), lse.stride(1),
    )
    block_l = max(16, triton.next_power_of_2(sel_block))
    _sel_bwd_dq_kernel[(T, B * G)](
        q, k, v, indices, do, gate, lse, delta, dq,
        *strides, indices.stride(0), indices.stride(1), indices.stride(2), *grad_strides,
        dq.stride(0), dq.stride(1), dq.stride(2),
        T, G, h, scale * LOG2E, scale, sel_block, n_sel,
        ACCUMULATE=accumulate, **_dims(Dk, Dv), HP=_row_pad(h), BLOCK_L=block_l, **_launch(q),
    )
    num_sel = -(-T // sel_block)
    on_gpu = q.device.type == "cuda"
    chunk = chunk or TUNING.inverse_chunk
    item_key, item_start, item_count, tokens = inverse_index(indices, num_sel, chunk)
    dk_out = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv_out = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    _sel_bwd_dkdv_kernel[(item_key.numel(),)](
        q, k, v, do, gate, lse, delta, dk_out, dv_out, item_key, item_start, item_count, tokens,
        *strides, *grad_strides,
        dk_out.stride(0), dk_out.stride(1), dk_out.stride(2), dv_out.stride(0), dv_out.stride(1), dv_out.stride(2),
        T, G, num_sel, h, scale * LOG2E, scale, sel_block,
        **_dims(Dk, Dv), BLOCK_L=block_l, BLOCK_R=TUNING.dkdv_block_r if on_gpu else 16,
        num_warps=TUNING.dkdv_warps if on_gpu else 1,
    )
    return dk_out, dv_out
