"""NSA decode attention: one new query per sequence, split over many programs.

A decode step has one query row per sequence, so one program per (sequence, key/value
group) would leave the GPU nearly idle at batch 1. The work is split instead, in four launches
(the group's h heads always packed into the rows of one tile):
  A. per chunk of K selection blocks, sequence and group: the compressed tokens starting in the
     chunk give a partial softmax (local max, sum, p @ v) and, per head, their Eq. 9 contributions
     to the chunk's selection blocks (and to the next chunk's: a compressed token can reach across a
     chunk edge). A program takes 1 to 8 consecutive chunks in a pipelined loop: several where the
     grid would otherwise hold thousands of programs (batch 16), one at batch 1;
  B. one program per (sequence, group): merges the chunks' (max, sum) into the compressed lse, rescales
     every chunk's contributions to exp(s - lse), sums the heads, and keeps a running top-n with the forced
     blocks (the same int64 ranking keys as the training selection). With more than one group of CT chunks
     (contexts past CT*K*l' tokens), no program walks every chunk in series: one program per (group of CT
     chunks, sequence, group) computes the lse from the chunks' (max, sum) alone, keeps its chunks' own top K and
     merges their compressed partials into one; the global top n is among the groups' top K, so the choice is
     the same, and the merge of the groups' lists happens in C;
  C. one program per (chosen block or window tile, sequence, group): a partial softmax over those raw tokens
     (only tokens <= t). With groups, each chosen-block program first merges the groups' top-K lists itself (the
     same keys give every program the same list) and takes its block from it: a launch fewer than a merge of
     its own;
  D. one program per (sequence, group, 16 output columns): merges the compressed, selected and window partials
     and forms the gated sum; it also counts the key/value tokens read.
Only the compressed stream, the chosen blocks and the window are loaded: Nc(t) + n*l' + w tokens.
Partials hold the h real heads only (their readers mask the padded rows), and the ranking kernels run
on 2 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..geometry import NSAGeometry
from ..tuning import TUNING
from . import launcher
from .common import (LOG2E, ceil_div, dot_precision, load_tile, merge_partials, merge_top, next_power_of_two, num_sms,
                     overlap, store_tile)
from .selection import stencil_rank


@triton.jit
def _chunk_kernel(
    Q, KC, VC, NCMP, PM, PL, PACC, PSC,
    sqb, sqh, scb, sct, scg,
    G, h, NCH, scale_log2, block_len, block_stride, sel_block, chunk_tokens,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, K: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CPP: tl.constexpr,
    STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(1)
    b = (pid // G).to(tl.int64)
    g = pid % G
    nc = tl.load(NCMP + b).to(tl.int32)
    dk, rh = tl.arange(0, BLOCK_DK), tl.arange(0, HP)
    row_ok = rh < h
    q = load_tile(Q + b * sqb, (g * h + tl.where(row_ok, rh, 0)).to(tl.int64) * sqh, dk, row_ok, DK)
    # CPP chunks a program, in a pipelined loop: the next chunk's keys and values load while this one's scores
    # are computed (Tuning.decode_chunk_programs_per_sm).
    c0 = tl.program_id(0) * CPP
    for c in tl.range(c0, tl.minimum(c0 + CPP, NCH), num_stages=STAGES):
        _chunk_partial(c, q, row_ok, KC, VC, PM, PL, PACC, PSC, b * scb + g * scg, sct, pid, nc, NCH,
                       scale_log2, block_len, block_stride, sel_block, chunk_tokens, DK, DV, BLOCK_DK, BLOCK_DV,
                       HP, K, C, R, DOT_PRECISION)


@triton.jit
def _chunk_partial(
    c, q, row_ok, KC, VC, PM, PL, PACC, PSC, base, sct, pid, nc, NCH,
    scale_log2, block_len, block_stride, sel_block, chunk_tokens,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, K: tl.constexpr, C: tl.constexpr, R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Chunk c's partial softmax and Eq. 9 contributions (see A in the module docstring)."""
    dk, dv, rh = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, HP)
    j0 = c * K
    ci_local = tl.arange(0, C)
    ci = (j0 * sel_block) // block_stride + ci_local
    ci_ok = (ci_local < chunk_tokens) & (ci < nc)
    off = ci.to(tl.int64) * sct
    # Values are loaded with the keys, before the scores: one memory round trip a program, not two.
    k, v = load_tile(KC + base, off, dk, ci_ok, DK), load_tile(VC + base, off, dv, ci_ok, DV)
    s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2).to(tl.float32)
    s = tl.where(ci_ok[None, :] & row_ok[:, None], s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    jj = tl.arange(0, K)
    # Exact fp32 products: the ranking must match the reference's. (Scores are cast to fp32 above:
    # under torch.compile a Python float argument arrives as fp64.)
    if R > 0:
        # R compressed tokens start in each selection block and none reaches past the next (l <= l'): a token's
        # weights depend only on its rank r in its block, into its block and into the next (what the overlap
        # matrices' two [C, K] products give, for far fewer operations).
        rr = tl.arange(0, R) * block_stride
        p_blk = tl.reshape(p, [HP, K, R])
        spill = tl.sum(p_blk * overlap(rr, 1, block_len, sel_block, block_stride)[None, None, :], 2)
        shift = (jj[:, None] + 1 == jj[None, :]).to(tl.float32)  # x @ shift moves column j to j + 1 (exactly)
        sc_cur = (tl.sum(p_blk * overlap(rr, 0, block_len, sel_block, block_stride)[None, None, :], 2)
                  + tl.dot(spill, shift, input_precision="ieee"))
        sc_nxt = tl.where(jj[None, :] == 0, tl.sum(tl.where(jj[None, :] == K - 1, spill, 0.0), 1)[:, None], 0.0)
    else:
        starts = (ci * block_stride)[:, None]
        w_cur = tl.where(ci_ok[:, None], overlap(starts, (j0 + jj)[None, :], block_len, sel_block, block_stride), 0.0)
        w_nxt = tl.where(ci_ok[:, None], overlap(starts, (j0 + K + jj)[None, :], block_len, sel_block, block_stride),
                         0.0)
        sc_cur = tl.dot(p, w_cur, input_precision="ieee")
        sc_nxt = tl.dot(p, w_nxt, input_precision="ieee")

    row = (pid * NCH + c).to(tl.int64) * HP + rh  # partial (program, chunk, head)
    # Only the h real rows are stored (the readers mask the padding): padded rows would be most of the writes.
    tl.store(PM + row, m, mask=row_ok)
    tl.store(PL + row, tl.sum(p, 1), mask=row_ok)
    tl.store(PACC + row[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])
    tl.store(PSC + row[:, None] * (2 * K) + jj[None, :], sc_cur, mask=row_ok[:, None])
    tl.store(PSC + row[:, None] * (2 * K) + K + jj[None, :], sc_nxt, mask=row_ok[:, None])


@triton.jit
def _merge_stats(PM, PL, first, count, h, HP: tl.constexpr, PT: tl.constexpr):
    """(max, sum) of `count` partial softmaxes: merge_partials's arithmetic in the same order, without the sums of
    p @ v, so that every program that needs the lse gets the same bits."""
    rh = tl.arange(0, HP)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    for p0 in range(0, count, PT):
        pp = p0 + tl.arange(0, PT)
        ok = pp < count
        row = (first + pp).to(tl.int64)[:, None] * HP + rh[None, :]
        ok = ok[:, None] & (rh < h)[None, :]
        m = tl.load(PM + row, mask=ok, other=float("-inf"))
        l_p = tl.load(PL + row, mask=ok, other=0.0)
        m_new = tl.maximum(m_i, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        f = tl.exp2(m - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(l_p * f, 0)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _lse2(m_i, l_i):
    has = l_i > 0
    return tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))  # no key: every p is 0


@triton.jit
def _chunk_keys(PM, PSC, first, c0, NCH, lse2, j_t, h, HP: tl.constexpr, K: tl.constexpr, CT: tl.constexpr):
    """Ranking keys [1, CT*K] of the selection blocks of chunks c0 .. c0+CT-1: the Eq. 9 scores rescaled to
    exp(s - lse) and summed over the heads, as score bits * 2^32 + (2^32 - 1 - j) (ties go to the lower
    block), the forced blocks at +inf, blocks after t's at -1."""
    rh, jj = tl.arange(0, HP), tl.arange(0, K)
    cc = c0 + tl.arange(0, CT)
    cur = (first + cc).to(tl.int64)[:, None] * HP + rh[None, :]  # [CT, HP]
    prev = cur - HP
    head_ok = (rh < h)[None, :]
    ok_cur = (cc < NCH)[:, None] & head_ok
    ok_prev = ((cc >= 1) & (cc - 1 < NCH))[:, None] & head_ok
    f_cur = tl.exp2(tl.load(PM + cur, mask=ok_cur, other=float("-inf")) - lse2[None, :])
    f_prev = tl.exp2(tl.load(PM + prev, mask=ok_prev, other=float("-inf")) - lse2[None, :])
    sc = tl.load(PSC + cur[:, :, None] * (2 * K) + jj[None, None, :], mask=ok_cur[:, :, None], other=0.0)
    sn = tl.load(PSC + prev[:, :, None] * (2 * K) + K + jj[None, None, :], mask=ok_prev[:, :, None], other=0.0)
    score = tl.sum(sc * f_cur[:, :, None], 1) + tl.sum(sn * f_prev[:, :, None], 1)  # [CT, K]
    j = (cc[:, None] * K + jj[None, :]).to(tl.int64)
    forced = (j == 0) | (j == j_t) | (j == j_t - 1)
    bits = tl.where(forced, 0x7F800000, score.to(tl.int32, bitcast=True).to(tl.int64))
    return tl.reshape(tl.where(j <= j_t, bits * 4294967296 + (4294967295 - j), -1), [1, CT * K])


@triton.jit
def _chosen_blocks(best, n_sel, K: tl.constexpr):
    """The top n_sel of `best` [1, K] (sorted by key, descending) as block indices [K] in ascending order, -1 in
    the slots past them."""
    jj = tl.arange(0, K)
    top = tl.reshape(best, [K])
    chosen = tl.where((top >= 0) & (jj < n_sel), 4294967295 - (top & 4294967295), -1)
    BIG: tl.constexpr = 2147483647
    chosen = tl.sort(tl.where(chosen >= 0, chosen, BIG).to(tl.int32))  # block indices fit: half the sort's work
    return tl.where(chosen == BIG, -1, chosen).to(tl.int64)


@triton.jit
def _store_chosen(chosen, IDX, b, g, sib, sig, n_sel, K: tl.constexpr):
    jj = tl.arange(0, K)
    tl.store(IDX + b * sib + g * sig + jj, chosen, mask=jj < n_sel)


@triton.jit
def _sequence(pid, G, POS, sel_block):
    """(sequence b, key/value group g, its position t, t's selection block) of a (sequence, group) program."""
    b = (pid // G).to(tl.int64)
    t = tl.load(POS + b)
    return b, pid % G, t, t // sel_block


@triton.jit
def _select_part_kernel(
    PM, PL, PACC, PSC, POS, PK, GM, GL, GACC, G, h, NCH, NCG, sel_block,
    HP: tl.constexpr, BLOCK_DV: tl.constexpr, K: tl.constexpr, CT: tl.constexpr, PT: tl.constexpr,
    PTS: tl.constexpr,
):
    cg = tl.program_id(0)
    pid = tl.program_id(1)
    _, _, _, j_t = _sequence(pid, G, POS, sel_block)
    first = pid * NCH
    # The group's chunks merged into one partial of the compressed branch, so that B2 merges NCG partials
    # rather than NCH (in one program, that merge would be a long serial walk).
    rh, dv = tl.arange(0, HP), tl.arange(0, BLOCK_DV)
    m_g, l_g, acc_g = merge_partials(PM, PL, PACC, first + cg * CT, tl.minimum(CT, NCH - cg * CT), h, HP, BLOCK_DV,
                                     PT, 0, BLOCK_DV)
    row = (pid * NCG + cg).to(tl.int64) * HP + rh
    tl.store(GM + row, m_g, mask=rh < h)
    tl.store(GL + row, l_g, mask=rh < h)
    tl.store(GACC + row[:, None] * BLOCK_DV + dv[None, :], acc_g, mask=(rh < h)[:, None])
    out = PK + (pid * NCG + cg).to(tl.int64) * K + tl.reshape(tl.arange(0, K), [1, K])
    if cg * CT * K > j_t:  # every block of this group comes after t's
        tl.store(out, tl.full([1, K], -1, tl.int64))
    else:
        # PTS chunks' statistics per load (at 64k all of them): a walk of PT at a time would be latency in series.
        m_i, l_i = _merge_stats(PM, PL, first, NCH, h, HP, PTS)
        key = _chunk_keys(PM, PSC, first, cg * CT, NCH, _lse2(m_i, l_i), j_t, h, HP, K, CT)
        tl.store(out, tl.topk(key, K))  # the group's top K, sorted by key, descending


@triton.jit
def _group_lists(PK, pid, NCG, c0, K: tl.constexpr, CT: tl.constexpr):
    """Groups c0 .. c0+CT-1's lists of K keys as one [1, CT*K] tile (-1 past the last group)."""
    kk = tl.arange(0, CT * K)
    grp = c0 + kk // K
    key = tl.load(PK + (pid * NCG + grp).to(tl.int64) * K + kk % K, mask=grp < NCG, other=-1)
    return tl.reshape(key, [1, CT * K])


@triton.jit
def _merged_top(PK, pid, NCG, j_t, K: tl.constexpr, CT: tl.constexpr):
    """The top K [1, K] (sorted by key, descending) of the NCG groups' lists of (sequence, group) program pid.
    CT groups' lists make one tile; groups past t's hold only -1. Only the running top K is kept: a top K of each
    tile merged into it (a top CT*K of the tile joined to the list sorted four times as many keys). The first
    tile needs no merge; up to 64k tokens it is the only one."""
    best = tl.topk(_group_lists(PK, pid, NCG, 0, K, CT), K)
    for c0 in range(CT, tl.minimum(NCG, (j_t // K) // CT + 1), CT):
        best = merge_top(best, tl.topk(_group_lists(PK, pid, NCG, c0, K, CT), K))
    return best


@triton.jit
def _select_kernel(
    PM, PSC, PL, POS, IDX,
    sib, sig, G, h, NCH, sel_block, n_sel,
    HP: tl.constexpr, K: tl.constexpr, CT: tl.constexpr, PT: tl.constexpr,
):
    pid = tl.program_id(0)
    b, g, _, j_t = _sequence(pid, G, POS, sel_block)
    first = pid * NCH
    m_i, l_i = _merge_stats(PM, PL, first, NCH, h, HP, PT)
    lse2 = _lse2(m_i, l_i)
    best = tl.topk(_chunk_keys(PM, PSC, first, 0, NCH, lse2, j_t, h, HP, K, CT), K)
    for c0 in range(CT, j_t // K + 1, CT):
        best = merge_top(best, tl.topk(_chunk_keys(PM, PSC, first, c0, NCH, lse2, j_t, h, HP, K, CT), K))
    _store_chosen(_chosen_blocks(best, n_sel, K), IDX, b, g, sib, sig, n_sel, K)


@triton.jit
def _span_kernel(
    Q, KS, VS, KW, VW, POS, IDX, PK, PM, PL, PACC, PR,
    sqb, sqh, ssb, sst, ssg, swb, swt, swg, sib, sig,
    G, h, NP, NCG, scale_log2, sel_block, n_sel, window,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HP: tl.constexpr, BLOCK_N: tl.constexpr, K: tl.constexpr, CT: tl.constexpr, RANK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // G).to(tl.int64)
    g = pid % G
    t = tl.load(POS + b)
    dk, dv, rh = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, HP)
    row_ok = rh < h
    q = load_tile(Q + b * sqb, (g * h + tl.where(row_ok, rh, 0)).to(tl.int64) * sqh, dk, row_ok, DK)
    if i < n_sel:  # one chosen block
        if RANK:  # the groups' lists merged here (B's last step); program 0 records the choice
            chosen = _chosen_blocks(_merged_top(PK, pid, NCG, t // sel_block, K, CT), n_sel, K)
            if i == 0:
                _store_chosen(chosen, IDX, b, g, sib, sig, n_sel, K)
            blk = tl.sum(tl.where(tl.arange(0, K) == i, chosen, 0))
        else:
            blk = tl.load(IDX + b * sib + g * sig + i)
        start = tl.where(blk >= 0, blk * sel_block, t + 1)  # an unused slot covers nothing
        stop = start + sel_block
        kp, vp, stride = KS + b * ssb + g * ssg, VS + b * ssb + g * ssg, sst
    else:  # one tile of the window
        start = tl.maximum(t - window + 1, 0) + (i - n_sel) * BLOCK_N
        stop = start + BLOCK_N
        kp, vp, stride = KW + b * swb + g * swg, VW + b * swb + g * swg, swt
    tok = start + tl.arange(0, BLOCK_N)
    ok = (tok < stop) & (tok <= t)
    off = tok.to(tl.int64) * stride
    k, v = load_tile(kp, off, dk, ok, DK), load_tile(vp, off, dv, ok, DV)  # both before the scores, as above
    s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2).to(tl.float32)
    s = tl.where(ok[None, :] & row_ok[:, None], s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    row = (pid * NP + i).to(tl.int64) * HP + rh
    tl.store(PM + row, m, mask=row_ok)
    tl.store(PL + row, tl.sum(p, 1), mask=row_ok)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    tl.store(PACC + row[:, None] * BLOCK_DV + dv[None, :], pv, mask=row_ok[:, None])
    tl.store(PR + pid * NP + i, tl.sum(ok.to(tl.int32)))


@triton.jit
def _combine_kernel(
    GATE, NCMP, CM, CL, CACC, PM, PL, PACC, PR, O, READS,
    sgb, sgh, sgc, sob, soh,
    G, h, NCP, NP, n_sel,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, HP: tl.constexpr, PC: tl.constexpr, PS: tl.constexpr,
    PW: tl.constexpr, DVT: tl.constexpr, NPP: tl.constexpr,
):
    # One program per (sequence, group, DVT output columns): each merges every partial in one load per branch
    # instead of one program per (sequence, group) walking them in series.
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * DVT
    b = (pid // G).to(tl.int64)
    g = pid % G
    rh, dv = tl.arange(0, HP), c0 + tl.arange(0, DVT)
    row_ok = rh < h
    head = (g * h + tl.where(row_ok, rh, 0)).to(tl.int64)
    # The compressed branch's NCP partials (chunks, or groups of chunks), then the selected and window ones.
    _, l_c, acc_c = merge_partials(CM, CL, CACC, pid * NCP, NCP, h, HP, BLOCK_DV, PC, c0, DVT)
    _, l_s, acc_s = merge_partials(PM, PL, PACC, pid * NP, n_sel, h, HP, BLOCK_DV, PS, c0, DVT)
    _, l_w, acc_w = merge_partials(PM, PL, PACC, pid * NP + n_sel, NP - n_sel, h, HP, BLOCK_DV, PW, c0, DVT)
    o_sel = acc_s / tl.where(l_s > 0, l_s, 1.0)[:, None]
    o_win = acc_w / tl.where(l_w > 0, l_w, 1.0)[:, None]
    o_cmp = acc_c / tl.where(l_c > 0, l_c, 1.0)[:, None]
    gate = GATE + b * sgb + head * sgh
    g_cmp = tl.load(gate, mask=row_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gate + sgc, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2 * sgc, mask=row_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win
    store_tile(O + b * sob, head * soh, dv, row_ok, o, DV)
    if c0 == 0:
        pp = tl.arange(0, NPP)
        reads = tl.sum(tl.load(PR + pid * NP + pp, mask=pp < NP, other=0))
        tl.store(READS + pid, (tl.load(NCMP + b) + reads).to(tl.int64))


def _chunks_per_program(n_chunks: int, programs: int, device: torch.device) -> int:
    """Chunks per program of the compressed pass: doubled (up to 8) while the grid keeps
    TUNING.decode_chunk_programs_per_sm programs per SM; 2 under the CPU interpreter, so that its tests cover
    the loop."""
    if device.type != "cuda":
        return 2
    target = TUNING.decode_chunk_programs_per_sm * num_sms(device)
    cpp = 1
    while cpp < 8 and ceil_div(n_chunks, 2 * cpp) * programs >= target:
        cpp *= 2
    return cpp


def decode_attention_triton(q: torch.Tensor, gates: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                            n_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor,
                            v_win: torch.Tensor, positions: torch.Tensor, *, geometry: NSAGeometry, scale: float,
                            selected: torch.Tensor, reads: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B,H,Dv] and reads [B,G] for queries q [B,H,Dk] at positions [B]; writes selected [B,G,n_sel] (and the
    reads into `reads`, int64 [B,G] with a unit last stride, when given).

    k_cmp/v_cmp [B,Nc_max,G,D] hold n_cmp [B] emitted tokens; k_sel..v_win [B,L,G,D] (any strides with a
    unit last dimension) hold every token up to t. Shapes depend only on the cache's capacity, so a step
    can be captured in a CUDA graph.
    """
    B, H, Dk = q.shape
    G, Dv, L = k_sel.shape[2], v_sel.shape[-1], k_sel.shape[1]
    block_len, block_stride, sel_block, n_sel, window = geometry.as_tuple()
    h = H // G
    # One set of strides serves keys and values (the cache allocates them alike).
    assert k_sel.stride() == v_sel.stride() and k_win.stride() == v_win.stride() and k_cmp.stride() == v_cmp.stride()
    # A chunk's K blocks must hold the top n_sel, and a compressed token must not reach past the next chunk.
    K = max(16, next_power_of_two(n_sel), next_power_of_two(-(-block_len // sel_block) + 1))
    chunk_tokens = K * sel_block // block_stride
    n_chunks = ceil_div(ceil_div(L, sel_block), K)
    HP = max(16, next_power_of_two(h))
    BLOCK_N = max(16, next_power_of_two(sel_block))  # a chosen block is one tile; so is a piece of window
    n_parts = n_sel + ceil_div(min(window, L), BLOCK_N)  # window tiles start at max(t - w + 1, 0)
    dims = dict(DK=Dk, DV=Dv, BLOCK_DK=max(16, next_power_of_two(Dk)),
                BLOCK_DV=max(16, next_power_of_two(Dv)))
    f32 = dict(device=q.device, dtype=torch.float32)
    bg = B * G
    pm, pl = torch.empty(bg, n_chunks, HP, **f32), torch.empty(bg, n_chunks, HP, **f32)
    pacc = torch.empty(bg, n_chunks, HP, dims["BLOCK_DV"], **f32)
    psc = torch.empty(bg, n_chunks, HP, 2 * K, **f32)
    sm, sl = torch.empty(bg, n_parts, HP, **f32), torch.empty(bg, n_parts, HP, **f32)
    sacc = torch.empty(bg, n_parts, HP, dims["BLOCK_DV"], **f32)
    sreads = torch.empty(bg, n_parts, device=q.device, dtype=torch.int32)
    o = torch.empty(B, H, Dv, device=q.device, dtype=q.dtype)
    if reads is None:
        reads = torch.empty(B, G, device=q.device, dtype=torch.int64)
    assert reads.shape == (B, G) and reads.dtype == torch.int64 and reads.stride() == (G, 1)
    warps = dict(num_warps=4 if q.is_cuda else 1)
    # The ranking kernels' sorting networks exchange keys between threads at every stage: fewer warps, fewer of
    # those exchanges go through shared memory (one warp spills).
    rank_warps = dict(num_warps=2 if q.is_cuda else 1)
    scale_log2 = scale * LOG2E
    precision = dot_precision(q.dtype)

    R = stencil_rank(block_len, block_stride, sel_block)
    cpp = _chunks_per_program(n_chunks, bg, q.device)
    launcher.launch(_chunk_kernel, (ceil_div(n_chunks, cpp), bg),
        q, k_cmp, v_cmp, n_cmp, pm, pl, pacc, psc, q.stride(0), q.stride(1),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        G, h, n_chunks, scale_log2, block_len, block_stride, sel_block, chunk_tokens,
        **dims, HP=HP, K=K, C=max(16, next_power_of_two(chunk_tokens)), R=R, CPP=cpp,
        STAGES=TUNING.decode_chunk_stages, DOT_PRECISION=precision, **warps)
    CT = 8  # chunks per ranking tile
    n_groups = ceil_div(n_chunks, CT)
    if n_groups > 1:
        part = torch.empty(bg, n_groups, K, device=q.device, dtype=torch.int64)
        gm, gl = torch.empty(bg, n_groups, HP, **f32), torch.empty(bg, n_groups, HP, **f32)
        gacc = torch.empty(bg, n_groups, HP, dims["BLOCK_DV"], **f32)
        launcher.launch(_select_part_kernel, (n_groups, bg),
            pm, pl, pacc, psc, positions, part, gm, gl, gacc, G, h, n_chunks, n_groups, sel_block, HP=HP,
            BLOCK_DV=dims["BLOCK_DV"], K=K, CT=CT, PT=CT, PTS=min(64, next_power_of_two(n_chunks)),
            **rank_warps)
        compressed = (gm, gl, gacc, n_groups)  # the span kernel merges the groups' lists
    else:
        part = selected  # not read: the choice is made here
        launcher.launch(_select_kernel, (bg,),
            pm, psc, pl, positions, selected, selected.stride(0), selected.stride(1), G, h, n_chunks,
            sel_block, n_sel, HP=HP, K=K, CT=CT, PT=8, **rank_warps)
        compressed = (pm, pl, pacc, n_chunks)
    launcher.launch(_span_kernel, (n_parts, bg),
        q, k_sel, v_sel, k_win, v_win, positions, selected, part, sm, sl, sacc, sreads, q.stride(0), q.stride(1),
        k_sel.stride(0), k_sel.stride(1), k_sel.stride(2), k_win.stride(0), k_win.stride(1), k_win.stride(2),
        selected.stride(0), selected.stride(1), G, h, n_parts, n_groups, scale_log2, sel_block, n_sel, window,
        **dims, HP=HP, BLOCK_N=BLOCK_N, K=K, CT=CT, RANK=n_groups > 1, DOT_PRECISION=precision, **warps)
    dvt = min(16, dims["BLOCK_DV"])
    cm, cl, cacc, n_compressed = compressed
    launcher.launch(_combine_kernel, (bg, dims["BLOCK_DV"] // dvt),
        gates, n_cmp, cm, cl, cacc, sm, sl, sacc, sreads, o, reads, gates.stride(0), gates.stride(1),
        gates.stride(2), o.stride(0), o.stride(1), G, h, n_compressed, n_parts, n_sel, DV=Dv,
        BLOCK_DV=dims["BLOCK_DV"], HP=HP, PC=min(16, next_power_of_two(n_compressed)), PS=next_power_of_two(n_sel),
        PW=next_power_of_two(n_parts - n_sel), DVT=dvt, NPP=next_power_of_two(n_parts), **warps)
    return o, reads
