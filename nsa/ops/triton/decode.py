"""NSA decode attention: one new query per sequence, every branch in one kernel.

One program per (sequence, key/value group), the group's h heads packed into the rows:
  1. the compressed branch over the emitted compressed tokens (online softmax, then its lse);
  2. the selection: p_cmp recomputed chunk by chunk, summed over the heads, mapped to
     selection-block scores with the Eq. 9 overlaps, merged into a running top-n with the
     forced blocks (the same int64 ranking keys as the training selection kernel);
  3. the selected branch over the chosen blocks' raw tokens (those <= t);
  4. the window branch over the last min(w, t + 1) tokens;
  5. the gated sum.
It also writes the chosen blocks and the number of key/value tokens it read. Only those
tokens are loaded: the decode step's memory traffic is Nc(t) + n*l' + w tokens, not t.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, load_tile, softmax_finish, softmax_step, store_tile
from .selection import _overlap


@triton.jit
def _attend_span(q, KP, VP, skt, start, stop, t, m_i, l_i, acc, dk, dv, scale_log2,
                 DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax update over raw tokens [start, stop) that are <= t; (m, l, acc, tokens read)."""
    read = tl.full([], 0, tl.int32)
    for s0 in range(start, stop, BLOCK_N):
        tok = s0 + tl.arange(0, BLOCK_N)
        ok = (tok < stop) & (tok <= t) & (tok >= 0)
        off = tok.to(tl.int64) * skt
        k = load_tile(KP, off, dk, ok, DK)
        v = load_tile(VP, off, dv, ok, DV)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc)
        read += tl.sum(ok.to(tl.int32))
    return m_i, l_i, acc, read


@triton.jit
def _decode_kernel(
    Q, GATE, KC, VC, NCMP, KS, VS, KW, VW, POS, O, IDX, READS,
    sqb, sqh, sgb, sgh, sgc, scb, sct, scg, ssb, sst, ssg, swb, swt, swg, sob, soh, sib, sig,
    G, h, L, scale_log2, block_len, block_stride, sel_block, n_sel, window, chunk_tokens,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SEL: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // G).to(tl.int64)
    g = pid % G
    t = tl.load(POS + b)
    nc = tl.load(NCMP + b).to(tl.int32)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    rh = tl.arange(0, HP)
    row_ok = rh < h
    head = (g * h + tl.where(row_ok, rh, 0)).to(tl.int64)
    q = load_tile(Q + b * sqb, head * sqh, dk, row_ok, DK)

    # 1. Compressed branch.
    kc_base, vc_base = KC + b * scb + g * scg, VC + b * scb + g * scg
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    for s0 in range(0, nc, BLOCK_N):
        ci = s0 + tl.arange(0, BLOCK_N)
        ok = ci < nc
        off = ci.to(tl.int64) * sct
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(load_tile(kc_base, off, dk, ok, DK))) * scale_log2,
                     float("-inf"))
        m_i, l_i, acc = softmax_step(s, load_tile(vc_base, off, dv, ok, DV), m_i, l_i, acc)
    o_cmp, lse = softmax_finish(m_i, l_i, acc)
    lse2 = lse * 1.4426950408889634

    # 2. Selection: Eq. 9 scores chunk by chunk (K blocks each), a running top-K of int64 keys.
    j_t = t // sel_block
    jj = tl.arange(0, K)
    ci_local = tl.arange(0, C)
    best = tl.full([1, K], -1, tl.int64)
    carry = tl.zeros([K], tl.float32)
    for c in range(0, j_t // K + 1):
        j0 = c * K
        ci = (j0 * sel_block) // block_stride + ci_local
        ci_ok = (ci_local < chunk_tokens) & (ci < nc)
        kc = load_tile(kc_base, ci.to(tl.int64) * sct, dk, ci_ok, DK)
        s = tl.dot(q, tl.trans(kc)) * scale_log2
        p = tl.exp2(tl.where(ci_ok[None, :] & row_ok[:, None], s - lse2[:, None], float("-inf")))
        p_tok = tl.sum(p, 0)  # the group's heads summed
        starts = (ci * block_stride)[:, None]
        w_cur = tl.where(ci_ok[:, None], _overlap(starts, (j0 + jj)[None, :], block_len, sel_block, block_stride), 0.0)
        w_nxt = tl.where(ci_ok[:, None], _overlap(starts, (j0 + K + jj)[None, :], block_len, sel_block,
                                                  block_stride), 0.0)
        score = tl.sum(p_tok[:, None] * w_cur, 0) + carry
        carry = tl.sum(p_tok[:, None] * w_nxt, 0)
        j = (j0 + jj).to(tl.int64)
        forced = (j == 0) | (j == j_t) | (j == j_t - 1)
        bits = tl.where(forced, 0x7F800000, score.to(tl.int32, bitcast=True).to(tl.int64))
        key = tl.where(j <= j_t, bits * 4294967296 + (4294967295 - j), -1)
        best = tl.topk(tl.reshape(tl.join(best, key[None, :]), [1, 2 * K]), K)
    chosen = tl.reshape(best, [K])
    chosen = tl.where((chosen >= 0) & (jj < n_sel), 4294967295 - (chosen & 4294967295), -1)
    BIG: tl.constexpr = 2147483647
    chosen = tl.sort(tl.where(chosen >= 0, chosen, BIG))
    chosen = tl.where(chosen == BIG, -1, chosen)
    tl.store(IDX + b * sib + g * sig + jj, chosen, mask=jj < n_sel)

    # 3. Selected branch over the chosen blocks.
    ks_base, vs_base = KS + b * ssb + g * ssg, VS + b * ssb + g * ssg
    m_s = tl.full([HP], float("-inf"), tl.float32)
    l_s = tl.zeros([HP], tl.float32)
    acc_s = tl.zeros([HP, BLOCK_DV], tl.float32)
    sel_read = tl.full([], 0, tl.int32)
    for i in range(0, n_sel):
        blk = tl.sum(tl.where(jj == i, chosen, 0))
        start = tl.where(blk >= 0, blk * sel_block, L)  # an unused slot reads nothing
        m_s, l_s, acc_s, read = _attend_span(q, ks_base, vs_base, sst, start, start + sel_block, t, m_s, l_s,
                                             acc_s, dk, dv, scale_log2, DK, DV, BLOCK_SEL)
        sel_read += read
    o_sel, _ = softmax_finish(m_s, l_s, acc_s)

    # 4. Window branch.
    lo = tl.maximum(t - window + 1, 0)
    m_w = tl.full([HP], float("-inf"), tl.float32)
    l_w = tl.zeros([HP], tl.float32)
    acc_w = tl.zeros([HP, BLOCK_DV], tl.float32)
    m_w, l_w, acc_w, win_read = _attend_span(q, KW + b * swb + g * swg, VW + b * swb + g * swg, swt, lo, t + 1, t,
                                             m_w, l_w, acc_w, dk, dv, scale_log2, DK, DV, BLOCK_N)
    o_win, _ = softmax_finish(m_w, l_w, acc_w)

    # 5. Gated sum.
    gate = GATE + b * sgb + head * sgh
    g_cmp = tl.load(gate, mask=row_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gate + sgc, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2 * sgc, mask=row_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win
    store_tile(O + b * sob, head * soh, dv, row_ok, o, DV)
    tl.store(READS + b * G + g, (nc + sel_read + win_read).to(tl.int64))


def decode_attention_triton(q: torch.Tensor, gates: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                            n_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor,
                            v_win: torch.Tensor, positions: torch.Tensor, *, block_len: int, block_stride: int,
                            sel_block: int, n_sel: int, window: int, scale: float,
                            selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B,H,Dv] and reads [B,G] for queries q [B,H,Dk] at positions [B]; writes selected [B,G,n_sel].

    k_cmp/v_cmp [B,Nc_max,G,D] hold n_cmp [B] emitted tokens; k_sel..v_win [B,L,G,D] (any strides
    with a unit last dimension) hold every token up to t.
    """
    B, H, Dk = q.shape
    G, Dv, L = k_sel.shape[2], v_sel.shape[-1], k_sel.shape[1]
    h = H // G
    K = max(16, triton.next_power_of_2(n_sel), triton.next_power_of_2(-(-block_len // sel_block) + 1))
    chunk_tokens = K * sel_block // block_stride
    o = torch.empty(B, H, Dv, device=q.device, dtype=q.dtype)
    reads = torch.empty(B, G, device=q.device, dtype=torch.int64)
    # One set of strides serves keys and values (the cache allocates them alike).
    assert k_sel.stride() == v_sel.stride() and k_win.stride() == v_win.stride() and k_cmp.stride() == v_cmp.stride()
    _decode_kernel[(B * G,)](
        q, gates, k_cmp, v_cmp, n_cmp, k_sel, v_sel, k_win, v_win, positions, o, selected, reads,
        q.stride(0), q.stride(1), gates.stride(0), gates.stride(1), gates.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), k_sel.stride(0), k_sel.stride(1), k_sel.stride(2),
        k_win.stride(0), k_win.stride(1), k_win.stride(2), o.stride(0), o.stride(1),
        selected.stride(0), selected.stride(1),
        G, h, L, scale * LOG2E, block_len, block_stride, sel_block, n_sel, window, chunk_tokens,
        DK=Dk, DV=Dv, BLOCK_DK=max(16, triton.next_power_of_2(Dk)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        HP=max(16, triton.next_power_of_2(h)), K=K, C=max(16, triton.next_power_of_2(chunk_tokens)),
        BLOCK_N=64 if q.is_cuda else 16, BLOCK_SEL=max(16, triton.next_power_of_2(sel_block)),
        num_warps=4 if q.is_cuda else 1,
    )
    return o, reads
