"""Selection: Eq. 9 block scores, the group sum and top-n with forced blocks, in one streaming pass.

One program per (tile of BLOCK_T tokens, key/value group). It walks the selection
blocks in chunks of K, recomputing p_cmp = exp(q.k_cmp * scale - lse_cmp) for the
compressed tokens that start inside the chunk, sums the group's heads, maps them to
selection-block scores with the overlap weights, and merges the chunk into a running
top-K list per token. No [T, Nc] or [T, Ns] matrix ever exists. Where l <= l' with l'/d a
power of two (M7C's and the paper's 32/16/64), the mapping is two weights per rank of a
token in its block and a one-column shift (fewer products than the overlap matrix, and its sums stay
within a thread once a group's heads are split into power-of-two sets); otherwise it
is a small exact-fp32 matrix product with the overlap weights.

A compressed token starting in chunk c can reach into chunk c + 1 (it spans l
tokens); that part is carried over. Ranking uses one int64 key per block:
(float bits of the score) << 32 | (2^32 - 1 - j), so larger scores win and equal
scores go to the lower j; forced blocks get the bits of +inf, non-candidates -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..tuning import TUNING
from . import launcher
from .common import LOG2E, ceil_div, dot_precision, ieee_products, merge_top, next_power_of_two, overlap


@triton.jit
def _chunk_keys(kbase, skt, c, chunk_tokens, ci_local, dk, NC, DK: tl.constexpr):
    """(k_cmp tile [C, BLOCK_DK], compressed token indices, which of them exist) of chunk c."""
    ci = c * chunk_tokens + ci_local
    ci_ok = (ci_local < chunk_tokens) & (ci < NC)
    kc = tl.load(kbase + ci.to(tl.int64)[:, None] * skt + dk[None, :], mask=ci_ok[:, None] & (dk[None, :] < DK),
                 other=0.0)
    return kc, ci, ci_ok


@triton.jit
def _chunk_p(q, kc, ci, ci_ok, rt, lse2, scale_log2, block_len, block_stride, BLOCK_T: tl.constexpr,
             HP: tl.constexpr, C: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr, MASKED: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """[BLOCK_T, C]: p_cmp summed over HP heads of each token (rows of q, token-major), for the chunk's compressed
    tokens kc.

    TRANS computes the scores transposed ([C, rows]): a token's HP heads are then neighbouring columns of the
    matrix product, which sum mostly within a thread; as rows they sit in HP lanes, three shuffle rounds per value
    at HP = 8. Large tiles stay untransposed (Tuning.select_transposed_max_rows: a [C, rows] product on 8 warps
    computes twice). Unmasked chunks are those every row of the tile sees whole; padded heads and
    rows past T have lse2 = +inf, so their p is 0 without a mask.
    """
    if TRANS:
        st = tl.dot(kc, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2 - lse2[None, :]
        if MASKED:
            st = tl.where(((ci * block_stride + block_len - 1)[:, None] <= rt[None, :]) & ci_ok[:, None], st,
                          float("-inf"))
        elif not EXACT:
            # Columns of the next chunk (C > chunk_tokens) get zero weights, but their p could overflow: 0 * inf.
            st = tl.where(ci_ok[:, None], st, float("-inf"))
        return tl.trans(tl.sum(tl.reshape(tl.exp2(st), [C, BLOCK_T, HP]), axis=2))
    else:
        s = tl.dot(q, tl.trans(kc), input_precision=DOT_PRECISION) * scale_log2 - lse2[:, None]
        if MASKED:
            s = tl.where((ci[None, :] * block_stride + block_len - 1 <= rt[:, None]) & ci_ok[None, :], s,
                         float("-inf"))
        elif not EXACT:
            s = tl.where(ci_ok[None, :], s, float("-inf"))
        return tl.sum(tl.reshape(tl.exp2(s), [BLOCK_T, HP, C]), axis=1)


@triton.jit
def group_p(qa, qb, kbase, skt, c, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2, block_len,
             block_stride, DK: tl.constexpr, BLOCK_T: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr,
             C: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr, MASKED: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """[BLOCK_T, C]: p_cmp summed over the group's heads (the first HA, then HB more) for chunk c's tokens."""
    kc, ci, ci_ok = _chunk_keys(kbase, skt, c, chunk_tokens, ci_local, dk, NC, DK)
    p = _chunk_p(qa, kc, ci, ci_ok, rta, lse2a, scale_log2, block_len, block_stride, BLOCK_T, HA, C, TRANS, EXACT,
                 MASKED, DOT_PRECISION)
    if HB > 0:
        p += _chunk_p(qb, kc, ci, ci_ok, rtb, lse2b, scale_log2, block_len, block_stride, BLOCK_T, HB, C, TRANS,
                      EXACT, MASKED, DOT_PRECISION)
    return p


@triton.jit
def head_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, first: tl.constexpr, HP: tl.constexpr,
               DK: tl.constexpr, BLOCK_T: tl.constexpr):
    """(q rows, their tokens, lse in log2 units) of heads first .. first + HP - 1 of the group (heads >= h padded:
    q 0, lse +inf) for the tile's BLOCK_T tokens, token-major."""
    r = tl.arange(0, BLOCK_T * HP)
    rt = pid_t * BLOCK_T + r // HP
    rh = first + r % HP
    row_ok = (rt < T) & (rh < h)
    head = (g * h + tl.where(rh < h, rh, 0)).to(tl.int64)
    rt64 = rt.to(tl.int64)
    q = tl.load(Q + b * sqb + rt64[:, None] * sqt + head[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    lse = tl.load(LSE + b * slb + rt64 * slt + head, mask=row_ok, other=float("inf"))
    return q, rt, lse * 1.4426950408889634


@triton.jit
def group_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, HA: tl.constexpr, HB: tl.constexpr,
               DK: tl.constexpr, BLOCK_T: tl.constexpr):
    """head_rows of the group's two head sets: (qa, rta, lse2a, qb, rtb, lse2b); the second is the first again
    where HB = 0."""
    # Rows: BLOCK_T tokens x HA heads (powers of two, so heads sum by a reshape), then x HB more heads where h is
    # not a power of two: at M7C's h = 6, 4 + 2 rows per token instead of 8 with 2 padded.
    qa, rta, lse2a = head_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, 0, HA, DK, BLOCK_T)
    qb, rtb, lse2b = qa, rta, lse2a
    if HB > 0:
        qb, rtb, lse2b = head_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, HA, HB, DK, BLOCK_T)
    return qa, rta, lse2a, qb, rtb, lse2b


@triton.jit
def tile_documents(DOC_START, tok, tile_first, T, BLOCK_T: tl.constexpr):
    """(one past the tile's last token, how many documents its tokens tok belong to) of a packed stream."""
    tile_end = tl.minimum(T, tile_first + BLOCK_T)
    starts = tl.load(DOC_START + tok, mask=tok < tile_end, other=0)
    return tile_end, 1 + tl.sum(((tok > tile_first) & (tok < tile_end) & (starts == tok)).to(tl.int32))


@triton.jit
def document_segment(DOC_START, DOC_END, CMP_START, first, tile_end, block_len, block_stride):
    """For the tile's tokens from `first` on that share its document: (the document's first token, the segment's
    last token, the document's compressed tokens, its first compressed row as int64)."""
    doc = tl.load(DOC_START + first)
    doc_end = tl.load(DOC_END + first)
    length = doc_end - doc
    nc = tl.where(length >= block_len, (length - block_len) // block_stride + 1, 0)
    return doc, tl.minimum(doc_end, tile_end) - 1, nc, tl.load(CMP_START + first).to(tl.int64)


@triton.jit
def block_scores(p_tok, carry, jj, w_cur, w_nxt, shift, K: tl.constexpr, R: tl.constexpr):
    """(chunk's block scores [rows, K]: Eq. 9 of its p_cmp p_tok plus what the previous chunk spilled into its first
    block, the spill into the next chunk)."""
    # Exact fp32 products: the ranking must match the reference's, ties included.
    if R > 0:
        p_blk = tl.reshape(p_tok, [p_tok.shape[0], K, R])
        spill = tl.sum(p_blk * w_nxt, axis=2)  # what block j's tokens put into block j + 1
        score = tl.sum(p_blk * w_cur, axis=2) + tl.dot(spill, shift, input_precision="ieee") + carry
        carry = tl.where(jj[None, :] == 0, tl.sum(tl.where(jj[None, :] == K - 1, spill, 0.0), 1)[:, None], 0.0)
    else:
        score = tl.dot(p_tok, w_cur, input_precision="ieee") + carry
        carry = tl.dot(p_tok, w_nxt, input_precision="ieee")
    return score, carry


@triton.jit
def _rank_chunk(p_tok, c, best, carry, jj, j_t, w_cur, w_nxt, shift, K: tl.constexpr, R: tl.constexpr):
    """Chunk c's block scores merged into the running top-K list `best`; returns (best, the spill into the next
    chunk)."""
    score, carry = block_scores(p_tok, carry, jj, w_cur, w_nxt, shift, K, R)
    j = (c * K + jj)[None, :].to(tl.int64)
    candidate = j <= j_t[:, None]
    forced = (j == 0) | (j == j_t[:, None]) | (j == j_t[:, None] - 1)
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    bits = tl.where(forced, 0x7F800000, bits)
    key = bits * 4294967296 + (4294967295 - j)
    return merge_top(best, tl.where(candidate, key, -1)), carry


@triton.jit
def chunk_plan(t_first, t_last, block_len, block_stride, sel_block, n_sel, chunk_tokens, K: tl.constexpr):
    """For rows of (document-relative) tokens t_first .. t_last: (whether every one chooses all its candidates,
    the chunks to walk, how many of them every row sees whole)."""
    # A tile whose tokens all have at most n candidate blocks chooses all of them: nothing to score.
    all_fit = t_last // sel_block < n_sel
    n_chunks = tl.where(all_fit, 0, (t_last // sel_block) // K + 1)
    # Chunks whose compressed tokens the first token (so every row) sees whole need no visibility mask.
    seen = tl.where(t_first >= block_len - 1, (t_first - block_len + 1) // block_stride + 1, 0)
    n_whole = tl.minimum(seen // chunk_tokens, n_chunks)
    return all_fit, n_chunks, n_whole


@triton.jit
def overlap_weights(jj, ci_local, block_len, block_stride, sel_block, chunk_tokens, K: tl.constexpr,
                     R: tl.constexpr):
    """(w_cur, w_nxt, shift): the Eq. 9 weights of a chunk's compressed tokens into its blocks and the next chunk's
    first, the same for every chunk (a chunk starts at a multiple of l')."""
    if R > 0:
        # R compressed tokens start in each selection block and none reaches past the next one (l <= l'):
        # a token's weight depends only on its rank r in its block, into that block and into the next.
        rr = tl.arange(0, R) * block_stride
        w_cur = overlap(rr, 0, block_len, sel_block, block_stride)[None, None, :]
        w_nxt = overlap(rr, 1, block_len, sel_block, block_stride)[None, None, :]
        shift = (jj[:, None] + 1 == jj[None, :]).to(tl.float32)  # x @ shift moves column j to j + 1
    else:
        # Columns past chunk_tokens (C is a power of two) belong to the next chunk: zero weights drop them.
        starts = (ci_local * block_stride)[:, None]
        in_chunk = (ci_local < chunk_tokens)[:, None]
        w_cur = tl.where(in_chunk, overlap(starts, jj[None, :], block_len, sel_block, block_stride), 0.0)
        w_nxt = tl.where(in_chunk, overlap(starts, (K + jj)[None, :], block_len, sel_block, block_stride), 0.0)
        shift = w_cur
    return w_cur, w_nxt, shift


@triton.jit
def _ranked(qa, qb, kbase, skt, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2, block_len,
            block_stride, j_t, jj, w_cur, w_nxt, shift, n_whole, n_chunks, DK: tl.constexpr, BLOCK_T: tl.constexpr,
            HA: tl.constexpr, HB: tl.constexpr, K: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
            TRANS: tl.constexpr, EXACT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The running top-K keys [BLOCK_T, K] (descending) of the rows' candidate blocks, over the compressed tokens
    kbase[0 .. NC) (one sequence's, or one document's) and the rows' (document-relative) tokens rta/rtb."""
    best = tl.full([BLOCK_T, K], -1, tl.int64)
    carry = tl.zeros([BLOCK_T, K], tl.float32)
    for c in range(0, n_whole):
        p_tok = group_p(qa, qb, kbase, skt, c, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2,
                         block_len, block_stride, DK, BLOCK_T, HA, HB, C, TRANS, EXACT, False, DOT_PRECISION)
        best, carry = _rank_chunk(p_tok, c, best, carry, jj, j_t, w_cur, w_nxt, shift, K, R)
    for c in range(n_whole, n_chunks):
        p_tok = group_p(qa, qb, kbase, skt, c, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2,
                         block_len, block_stride, DK, BLOCK_T, HA, HB, C, TRANS, EXACT, True, DOT_PRECISION)
        best, carry = _rank_chunk(p_tok, c, best, carry, jj, j_t, w_cur, w_nxt, shift, K, R)
    return best


@triton.jit
def _store_choice(IDX, b, sib, tok, sit, g, sig, best, jj, j_t, all_fit, n_sel, first, end, PACKED: tl.constexpr):
    """Stores the rows' n_sel chosen blocks (ascending, -1 padded) for the tokens tok in [first, end) (unpacked:
    tok < end, every row's token is >= first)."""
    # `best` is sorted by key, descending: keep the first n_sel, then order them by block index.
    chosen = tl.where((best >= 0) & (jj[None, :] < n_sel), 4294967295 - (best & 4294967295), -1)
    BIG: tl.constexpr = 2147483647
    chosen = tl.sort(tl.where(chosen >= 0, chosen, BIG))  # ascending; padding sorts last
    chosen = tl.where(chosen == BIG, -1, chosen)
    chosen = tl.where(all_fit, tl.where(jj[None, :] <= j_t[:, None], jj[None, :], -1), chosen)
    if PACKED:
        store_ok = (tok[:, None] >= first) & (tok[:, None] < end)
    else:
        store_ok = tok[:, None] < end
    tl.store(IDX + b * sib + tok.to(tl.int64)[:, None] * sit + g * sig + jj[None, :], chosen,
             mask=store_ok & (jj[None, :] < n_sel))


@triton.jit
def _select_kernel(
    Q, KC, LSE, IDX, DOC_START, DOC_END, CMP_START,
    sqb, sqt, sqh, skb, skt, skg, slb, slt, sib, sit, sig,
    T, NC, G, h, scale_log2, block_len, block_stride, sel_block, n_sel, chunk_tokens,
    DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_T: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr,
    K: tl.constexpr, C: tl.constexpr, R: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr,
    PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    dk = tl.arange(0, BLOCK_DK)
    qa, rta, lse2a, qb, rtb, lse2b = group_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, HA, HB, DK,
                                                BLOCK_T)

    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if PACKED:
        jj = tl.arange(0, K)
        ci_local = tl.arange(0, C)
        # The tile's tokens may belong to several documents: each document's rows are ranked on their own, against
        # that document's compressed tokens and in its own positions, the other rows' p held at 0 (lse +inf).
        tile_end, n_docs = tile_documents(DOC_START, tok, pid_t * BLOCK_T, T, BLOCK_T)
        w_cur, w_nxt, shift = overlap_weights(jj, ci_local, block_len, block_stride, sel_block, chunk_tokens, K, R)
        first = pid_t * BLOCK_T
        for _ in range(n_docs):
            doc, last, nc, cmp_first = document_segment(DOC_START, DOC_END, CMP_START, first, tile_end, block_len,
                                                        block_stride)
            kbase = KC + b * skb + g * skg + cmp_first * skt
            j_t = (tok - doc) // sel_block
            all_fit, n_chunks, n_whole = chunk_plan(first - doc, last - doc, block_len, block_stride, sel_block,
                                                     n_sel, chunk_tokens, K)
            best = _ranked(qa, qb, kbase, skt, chunk_tokens, ci_local, dk, rta - doc, rtb - doc,
                           tl.where((rta >= first) & (rta <= last), lse2a, float("inf")),
                           tl.where((rtb >= first) & (rtb <= last), lse2b, float("inf")), nc, scale_log2, block_len,
                           block_stride, j_t, jj, w_cur, w_nxt, shift, n_whole, n_chunks, DK, BLOCK_T, HA, HB, K, C,
                           R, TRANS, EXACT, DOT_PRECISION)
            _store_choice(IDX, b, sib, tok, sit, g, sig, best, jj, j_t, all_fit, n_sel, first, last + 1, PACKED)
            first = last + 1
    else:
        j_t = tok // sel_block
        t_first = pid_t * BLOCK_T
        t_last = tl.minimum(T - 1, t_first + BLOCK_T - 1)
        all_fit, n_chunks, n_whole = chunk_plan(t_first, t_last, block_len, block_stride, sel_block, n_sel,
                                                 chunk_tokens, K)
        jj = tl.arange(0, K)
        ci_local = tl.arange(0, C)
        w_cur, w_nxt, shift = overlap_weights(jj, ci_local, block_len, block_stride, sel_block, chunk_tokens, K, R)
        kbase = KC + b * skb + g * skg
        best = _ranked(qa, qb, kbase, skt, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2,
                       block_len, block_stride, j_t, jj, w_cur, w_nxt, shift, n_whole, n_chunks, DK, BLOCK_T, HA, HB,
                       K, C, R, TRANS, EXACT, DOT_PRECISION)
        _store_choice(IDX, b, sib, tok, sit, g, sig, best, jj, j_t, all_fit, n_sel, 0, T, PACKED)


def stencil_rank(block_len: int, block_stride: int, sel_block: int) -> int:
    """R = l'/d compressed tokens per selection block where Eq. 9 reduces to two weights per rank in the block
    (l <= l', R a power of two: every token lies in its block and at most the next); 0 for general overlaps."""
    per_block = sel_block // block_stride
    ok = block_len <= sel_block and sel_block % block_stride == 0 and per_block & (per_block - 1) == 0
    return per_block if ok else 0


def scoring_launch(q: torch.Tensor, groups: int, geometry: NSAGeometry) -> tuple[int, dict]:
    """(compressed tokens per chunk, a launch's constexprs and warps/stages) of a kernel that scores the selection
    blocks of queries q [B,T,H,Dk] over `groups` key/value groups in chunks of K blocks, BLOCK_T tokens a program
    (the streaming kernel and the split one's score kernel)."""
    Dk = q.shape[-1]
    block_len, block_stride, sel_block, n_sel, _ = geometry.as_tuple()
    h = q.shape[2] // groups
    # The running list must hold n and each chunk must contain every block a compressed token reaches into.
    K = max(16, next_power_of_two(n_sel), next_power_of_two(-(-block_len // sel_block) + 1))
    chunk_tokens = K * sel_block // block_stride
    hp = next_power_of_two(h)
    on_gpu = q.device.type == "cuda"
    block_t = TUNING.select_block_t if on_gpu else 16
    ieee = ieee_products(q)
    if ieee:  # at most 32 (token, head) rows: IEEE products hold their operands in registers (ieee_products)
        block_t = max(1, 32 // hp)
    trans = block_t * hp <= TUNING.select_transposed_max_rows
    # Transposed, the heads split into a power of two and a padded rest (h = 6: 4 + 2); untransposed they stay one
    # padded set (the paper's h = 16 is a power of two either way).
    ha = 1 << (h.bit_length() - 1) if trans else hp
    hb = next_power_of_two(h - ha) if h > ha else 0
    # With the heads split, the two-weight stencil is the cheaper Eq. 9 transposed too (with the heads padded its
    # sums over a block's ranks would cross lanes).
    R = stencil_rank(block_len, block_stride, sel_block)
    C = max(16, next_power_of_two(chunk_tokens))
    return chunk_tokens, dict(
        DK=Dk, BLOCK_DK=max(16, next_power_of_two(Dk)), BLOCK_T=block_t,
        HA=ha, HB=hb, K=K, C=C, R=R, TRANS=trans, EXACT=C == chunk_tokens, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=(8 if ieee or block_t * hp > 128 else TUNING.select_warps) if on_gpu else 1,
        num_stages=1 if Dk > 128 or ieee else 2,  # head dim 192: the q tile alone is 128 KB
    )


def select_blocks_fwd(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, scale: float,
                      geometry: NSAGeometry, layout: PackedLayout | None = None) -> torch.Tensor:
    """Indices [B,T,G,n_sel] (int64, ascending, -1 padded) from q, k_cmp and the compressed branch's lse.

    With `layout`, q is a packed stream [1, total, H, Dk] and k_cmp holds its documents' compressed tokens back to
    back: each document is ranked alone, and its indices are relative to its own first block."""
    B, T, H, _ = q.shape
    NC, G = k_cmp.shape[1], k_cmp.shape[2]
    block_len, block_stride, sel_block, n_sel, _ = geometry.as_tuple()
    chunk_tokens, launch = scoring_launch(q, G, geometry)
    idx = torch.empty(B, T, G, n_sel, device=q.device, dtype=torch.int64)
    grid = (ceil_div(T, launch["BLOCK_T"]), B * G)
    packed_tables = (None,) * 3 if layout is None else (layout.doc_start, layout.doc_end, layout.cmp_start)
    launcher.launch(_select_kernel, grid,
        q, k_cmp, lse_cmp, idx, *packed_tables,
        q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        lse_cmp.stride(0), lse_cmp.stride(1), idx.stride(0), idx.stride(1), idx.stride(2),
        T, NC, G, H // G, scale * LOG2E, block_len, block_stride, sel_block, n_sel, chunk_tokens,
        PACKED=layout is not None, **launch,
    )
    return idx
