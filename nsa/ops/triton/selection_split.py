"""Selection in two kernels: Eq. 9 block scores into a buffer, then top-n over each row of it.

The alternative to the streaming kernel of selection.py, behind TUNING.selection_split.

1. `_score_kernel`, one program per (tile of BLOCK_T tokens, key/value group): the streaming kernel's walk over
   the chunks of K selection blocks (selection.py's helpers: p_cmp of the group's heads summed as it goes, the
   overlap weights or the two-weight stencil, a compressed token's spill carried into the next chunk), but each
   chunk's scores are stored instead of merged into a running list. The buffer is float32 [B, G, T, Ns]: one
   (batch, group)'s rows are contiguous, so a top-n program reads whole rows. Forced blocks (0, the query's block
   and the one before) hold +inf, the other candidates their score, blocks past the query's -inf. Columns past
   the last block a tile reaches, and the rows of tiles whose every query takes all its candidates, are never
   written: the top-n kernel does not read them.
2. `_top_kernel`, one program per (BLOCK_R rows, batch x group): each row's candidate scores as int64 keys held in
   registers, (float bits of the score) << 32 | (2^32 - 1 - j) as the streaming kernel ranks them (+inf's bits
   for forced blocks, -1 for non-candidates), then n argmax passes, each taking the row's largest key and
   removing it: no sorting network over the row's blocks. The n chosen blocks are then ordered by index (a sort
   of n), as the streaming kernel stores them; a row with at most n candidates takes them all.

Packed documents (a PackedLayout): the score kernel ranks each document's rows of a tile on their own, in
document-relative blocks, as the streaming kernel does; the top-n kernel finds a row's candidates from its
document's first token. Indices are document-relative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..geometry import NSAGeometry, num_selection_blocks
from ..packing import PackedLayout
from ..tuning import TUNING
from .common import LOG2E
from .selection import (block_scores, chunk_plan, document_segment, group_p, group_rows, overlap_weights,
                        scoring_launch, tile_documents)

MAX_BLOCKS = 8192
"""The most selection blocks a sequence may have on the split path: a row's keys live in registers, at most 16 a
thread on 16 warps."""


@triton.jit
def _store_scores(S, s_base, sst, tok, row_ok, j, j_t, score, NS):
    """Stores a chunk's scores [rows, K] of blocks j: +inf for forced blocks, -inf past each row's block."""
    forced = (j == 0) | (j == j_t[:, None]) | (j == j_t[:, None] - 1)
    marked = tl.where(j <= j_t[:, None], tl.where(forced, float("inf"), score), float("-inf"))
    tl.store(S + s_base + tok.to(tl.int64)[:, None] * sst + j, marked, mask=row_ok[:, None] & (j < NS))


@triton.jit
def _score_rows(S, s_base, sst, tok, row_ok, NS, qa, qb, kbase, skt, chunk_tokens, ci_local, dk, rta, rtb, lse2a,
                lse2b, NC, scale_log2, block_len, block_stride, j_t, jj, w_cur, w_nxt, shift, n_whole, n_chunks,
                DK: tl.constexpr, BLOCK_T: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, K: tl.constexpr,
                C: tl.constexpr, R: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Stores the block scores of the rows tok (where row_ok) over the compressed tokens kbase[0 .. NC), chunk by
    chunk: the streaming kernel's _ranked, with a store where it merges."""
    carry = tl.zeros([BLOCK_T, K], tl.float32)
    for c in range(0, n_whole):
        p_tok = group_p(qa, qb, kbase, skt, c, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2,
                        block_len, block_stride, DK, BLOCK_T, HA, HB, C, TRANS, EXACT, False, DOT_PRECISION)
        score, carry = block_scores(p_tok, carry, jj, w_cur, w_nxt, shift, K, R)
        _store_scores(S, s_base, sst, tok, row_ok, (c * K + jj)[None, :], j_t, score, NS)
    for c in range(n_whole, n_chunks):
        p_tok = group_p(qa, qb, kbase, skt, c, chunk_tokens, ci_local, dk, rta, rtb, lse2a, lse2b, NC, scale_log2,
                        block_len, block_stride, DK, BLOCK_T, HA, HB, C, TRANS, EXACT, True, DOT_PRECISION)
        score, carry = block_scores(p_tok, carry, jj, w_cur, w_nxt, shift, K, R)
        _store_scores(S, s_base, sst, tok, row_ok, (c * K + jj)[None, :], j_t, score, NS)


@triton.jit
def _score_kernel(
    Q, KC, LSE, S, DOC_START, DOC_END, CMP_START,
    sqb, sqt, sqh, skb, skt, skg, slb, slt, ssb, ssg, sst,
    T, NC, G, h, scale_log2, block_len, block_stride, sel_block, n_sel, chunk_tokens, NS,
    DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_T: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr,
    K: tl.constexpr, C: tl.constexpr, R: tl.constexpr, TRANS: tl.constexpr, EXACT: tl.constexpr,
    PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = (pid_bg % G).to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    qa, rta, lse2a, qb, rtb, lse2b = group_rows(Q, LSE, b, g, h, pid_t, T, sqb, sqt, sqh, slb, slt, dk, HA, HB, DK,
                                                BLOCK_T)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, K)
    ci_local = tl.arange(0, C)
    w_cur, w_nxt, shift = overlap_weights(jj, ci_local, block_len, block_stride, sel_block, chunk_tokens, K, R)
    s_base = b * ssb + g * ssg
    if PACKED:
        # As the streaming kernel: each document's rows of the tile against its own compressed tokens, in its own
        # positions, the other rows' p held at 0 (lse +inf) and their scores not stored.
        tile_end, n_docs = tile_documents(DOC_START, tok, pid_t * BLOCK_T, T, BLOCK_T)
        first = pid_t * BLOCK_T
        for _ in range(n_docs):
            doc, last, nc, cmp_first = document_segment(DOC_START, DOC_END, CMP_START, first, tile_end, block_len,
                                                        block_stride)
            kbase = KC + b * skb + g * skg + cmp_first * skt
            _, n_chunks, n_whole = chunk_plan(first - doc, last - doc, block_len, block_stride, sel_block, n_sel,
                                              chunk_tokens, K)
            _score_rows(S, s_base, sst, tok, (tok >= first) & (tok <= last), NS, qa, qb, kbase, skt, chunk_tokens,
                        ci_local, dk, rta - doc, rtb - doc,
                        tl.where((rta >= first) & (rta <= last), lse2a, float("inf")),
                        tl.where((rtb >= first) & (rtb <= last), lse2b, float("inf")), nc, scale_log2, block_len,
                        block_stride, (tok - doc) // sel_block, jj, w_cur, w_nxt, shift, n_whole, n_chunks, DK,
                        BLOCK_T, HA, HB, K, C, R, TRANS, EXACT, DOT_PRECISION)
            first = last + 1
    else:
        t_first = pid_t * BLOCK_T
        t_last = tl.minimum(T - 1, t_first + BLOCK_T - 1)
        _, n_chunks, n_whole = chunk_plan(t_first, t_last, block_len, block_stride, sel_block, n_sel, chunk_tokens,
                                          K)
        _score_rows(S, s_base, sst, tok, tok < T, NS, qa, qb, KC + b * skb + g * skg, skt, chunk_tokens, ci_local,
                    dk, rta, rtb, lse2a, lse2b, NC, scale_log2, block_len, block_stride, tok // sel_block, jj, w_cur,
                    w_nxt, shift, n_whole, n_chunks, DK, BLOCK_T, HA, HB, K, C, R, TRANS, EXACT, DOT_PRECISION)


@triton.jit
def _top_kernel(
    S, IDX, DOC_START,
    ssb, ssg, sst, sib, sit, sig,
    T, G, sel_block, n_sel,
    BLOCK_R: tl.constexpr, NSP: tl.constexpr, NP: tl.constexpr, PACKED: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = (pid_bg % G).to(tl.int64)
    tok = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = tok < T
    if PACKED:
        j_t = (tok - tl.load(DOC_START + tok, mask=row_ok, other=0)) // sel_block
    else:
        j_t = tok // sel_block
    j = tl.arange(0, NSP)
    # Rows with at most n candidates take them all; only the others were scored (or need to be read).
    ranked = row_ok & (j_t >= n_sel)
    seen = ranked[:, None] & (j[None, :] <= j_t[:, None])
    s = tl.load(S + b * ssb + g * ssg + tok.to(tl.int64)[:, None] * sst + j[None, :], mask=seen,
                other=float("-inf"))
    # Scores are >= 0 (sums of probabilities), so their float bits order as the floats; +inf (forced) is the
    # largest, and equal scores go to the lower j.
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(seen & (s != float("-inf")), bits * 4294967296 + (4294967295 - j[None, :].to(tl.int64)), -1)
    slot = tl.arange(0, NP)
    chosen = tl.full([BLOCK_R, NP], -1, tl.int64)
    for i in range(n_sel):
        top = tl.max(key, axis=1)
        chosen = tl.where(slot[None, :] == i, tl.where(top >= 0, 4294967295 - (top & 4294967295), -1)[:, None],
                          chosen)
        key = tl.where(key == top[:, None], -1, key)  # keys are distinct within a row: one block leaves
    BIG: tl.constexpr = 2147483647
    chosen = tl.sort(tl.where(chosen >= 0, chosen, BIG))  # ascending; padding sorts last
    chosen = tl.where(chosen == BIG, -1, chosen)
    chosen = tl.where(ranked[:, None], chosen, tl.where(slot[None, :] <= j_t[:, None], slot[None, :], -1))
    tl.store(IDX + b * sib + tok.to(tl.int64)[:, None] * sit + g * sig + slot[None, :], chosen,
             mask=row_ok[:, None] & (slot[None, :] < n_sel))


def supports(seq_len: int, geometry: NSAGeometry) -> bool:
    """Whether the split kernels serve a sequence (or packed stream) of seq_len tokens: at most MAX_BLOCKS
    selection blocks."""
    return num_selection_blocks(seq_len, geometry.sel_block) <= MAX_BLOCKS


def _top_launch(num_blocks: int, n_sel: int, on_gpu: bool) -> dict:
    """The top-n kernel's constexprs and warps: rows of NSP keys, BLOCK_R rows per program."""
    nsp = max(16, triton.next_power_of_2(num_blocks))
    keys = TUNING.select_top_keys if on_gpu else 256
    warps = min(16, max(4, nsp // 512)) if on_gpu else 1
    return dict(BLOCK_R=max(1, keys // nsp), NSP=nsp, NP=max(2, triton.next_power_of_2(n_sel)), num_warps=warps)


def select_blocks_split(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, scale: float,
                        geometry: NSAGeometry, layout: PackedLayout | None = None) -> torch.Tensor:
    """selection.select_blocks_fwd's indices [B,T,G,n_sel] (int64, ascending, -1 padded; document-relative with
    `layout`) by the score and top-n kernels; `supports(T, geometry)` must hold."""
    B, T, H, _ = q.shape
    NC, G = k_cmp.shape[1], k_cmp.shape[2]
    block_len, block_stride, sel_block, n_sel, _ = geometry.as_tuple()
    num_blocks = num_selection_blocks(T, sel_block)
    chunk_tokens, launch = scoring_launch(q, G, geometry)
    scores = torch.empty(B, G, T, num_blocks, device=q.device, dtype=torch.float32)
    idx = torch.empty(B, T, G, n_sel, device=q.device, dtype=torch.int64)
    packed = layout is not None
    packed_tables = (None,) * 3 if layout is None else (layout.doc_start, layout.doc_end, layout.cmp_start)
    _score_kernel[(triton.cdiv(T, launch["BLOCK_T"]), B * G)](
        q, k_cmp, lse_cmp, scores, *packed_tables,
        q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        lse_cmp.stride(0), lse_cmp.stride(1), scores.stride(0), scores.stride(1), scores.stride(2),
        T, NC, G, H // G, scale * LOG2E, block_len, block_stride, sel_block, n_sel, chunk_tokens, num_blocks,
        PACKED=packed, **launch,
    )
    top = _top_launch(num_blocks, n_sel, q.device.type == "cuda")
    _top_kernel[(triton.cdiv(T, top["BLOCK_R"]), B * G)](
        scores, idx, packed_tables[0],
        scores.stride(0), scores.stride(1), scores.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        T, G, sel_block, n_sel, PACKED=packed, **top,
    )
    return idx
