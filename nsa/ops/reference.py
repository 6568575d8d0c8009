"""Pure-PyTorch NSA: the oracle every fast backend is checked against.

A direct transcription of the contract (docs/design.md), vectorised over batch, heads and
blocks. Queries are processed in chunks so that no [T, T] score matrix exists
at once; under autograd each chunk is recomputed in backward (activation
checkpointing) so memory stays O(T * chunk) per head instead of O(T^2).

Layouts: q [B,T,H,Dk]; k_*/v_* [B,T,G,D]; k_cmp/v_cmp [B,Nc,G,D]; gates [B,T,H,3]
in (cmp, sel, win) order; head h uses key/value group h // (H // G).
All arithmetic runs in at least float32; outputs come back in q's dtype.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .geometry import (NSAGeometry, compressed_block_ends, compressed_offsets, geometry_from, num_selection_blocks,
                       overlap_matrix)
from .validation import check_nsa_inputs, document_bounds

QUERY_CHUNK = 256
"""Queries per chunk: bounds the live score matrix to [QUERY_CHUNK, keys] per head."""


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _split_heads(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[B,C,H,D] -> [B,C,G,h,D]: heads of one key/value group are adjacent."""
    b, c, h, d = q.shape
    return q.reshape(b, c, groups, h // groups, d)


def _probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax weights [B,G,h,C,S] of q [B,C,G,h,Dk] over k [B,S,G,Dk].

    `allowed` is [B|1, G|1, C, S]; a query with no allowed key gets all-zero weights.
    """
    s = torch.einsum("bcghd,bsgd->bghcs", q, k) * scale
    s = s.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    # Subtracting the row max is only for stability; detaching it leaves the softmax unchanged.
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    z = p.sum(-1, keepdim=True)
    return p / torch.where(z > 0, z, torch.ones_like(z))


def _attend(q, k, v, allowed, scale) -> torch.Tensor:
    """Attention output [B,C,H,Dv] of grouped queries q [B,C,G,h,Dk] over k/v [B,S,G,D].

    `allowed` is [B|1, G|1, C, S]. A query with no allowed key outputs zeros: it is
    given a dummy all-True row for SDPA (avoiding NaN) and its output is masked out.
    """
    b, c, g, h, dk = q.shape
    has_key = allowed.any(-1, keepdim=True)
    allowed = allowed | ~has_key
    o = F.scaled_dot_product_attention(
        q.flatten(2, 3).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed.repeat_interleave(h, dim=1) if allowed.shape[1] > 1 else allowed,
        scale=scale,
        enable_gqa=True,
    )  # [B,H,C,Dv]
    keep = has_key.repeat_interleave(h, dim=1) if has_key.shape[1] > 1 else has_key
    return torch.where(keep, o, torch.zeros_like(o)).transpose(1, 2)


def _over_query_chunks(fn, q: torch.Tensor, *args) -> torch.Tensor:
    """Concatenate fn(c0, c1, q[:, c0:c1], *args) over query chunks along T."""
    seq_len = q.shape[1]
    recompute = torch.is_grad_enabled() and seq_len > QUERY_CHUNK
    outs = []
    for c0 in range(0, seq_len, QUERY_CHUNK):
        c1 = min(seq_len, c0 + QUERY_CHUNK)
        if recompute:
            outs.append(checkpoint(fn, c0, c1, q[:, c0:c1], *args, use_reentrant=False))
        else:
            outs.append(fn(c0, c1, q[:, c0:c1], *args))
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------- compressed branch


def _cmp_visible(c0: int, c1: int, num_cmp: int, block_len: int, block_stride: int, device) -> torch.Tensor:
    """[1, 1, C, Nc] bool: compressed token i is visible to query t iff i*d + l - 1 <= t."""
    t = torch.arange(c0, c1, device=device)
    ends = compressed_block_ends(num_cmp, block_len, block_stride, device=device)
    return (ends[None, :] <= t[:, None])[None, None]


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    scale: float | None = None,
) -> torch.Tensor:
    """o_cmp [B,T,H,Dv]: attention over the visible compressed tokens; zero where none is visible."""
    scale = _default_scale(q, scale)
    dtype = _compute_dtype(q, k_cmp, v_cmp)
    groups, num_cmp = k_cmp.shape[2], k_cmp.shape[1]
    if num_cmp == 0:  # T < l: no compressed token exists yet, so no query sees one.
        # Adding the (zero) sums keeps the empty k_cmp/v_cmp in the graph: their gradients are empty tensors.
        return q.new_zeros(*q.shape[:-1], v_cmp.shape[-1]) + 0 * (k_cmp.sum() + v_cmp.sum()).to(q.dtype)

    def chunk(c0, c1, qc, k, v):
        allowed = _cmp_visible(c0, c1, num_cmp, block_len, block_stride, qc.device)
        return _attend(_split_heads(qc, groups), k, v, allowed, scale)

    out = _over_query_chunks(chunk, q.to(dtype), k_cmp.to(dtype), v_cmp.to(dtype))
    return out.to(q.dtype)


# ---------------------------------------------------------------- selection


@torch.no_grad()
def selection_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block: int,
    scale: float | None = None,
) -> torch.Tensor:
    """s [B,T,G,Ns]: Eq. 9 mapping of p_cmp onto selection blocks, summed over each group's heads."""
    scale = _default_scale(q, scale)
    dtype = _compute_dtype(q, k_cmp)
    seq_len, groups, num_cmp = q.shape[1], k_cmp.shape[2], k_cmp.shape[1]
    num_sel = num_selection_blocks(seq_len, sel_block)
    if num_cmp == 0:
        return torch.zeros(q.shape[0], seq_len, groups, num_sel, dtype=dtype, device=q.device)
    weights = overlap_matrix(num_cmp, num_sel, block_len, block_stride, sel_block, dtype=dtype, device=q.device)
    k = k_cmp.to(dtype)

    def chunk(c0, c1, qc):
        return block_scores(qc, k, c0, weights, block_len=block_len, block_stride=block_stride, scale=scale)

    return _over_query_chunks(chunk, q.to(dtype))


def block_scores(q: torch.Tensor, k_cmp: torch.Tensor, first: int, weights: torch.Tensor, *, block_len: int,
                 block_stride: int, scale: float) -> torch.Tensor:
    """s [B,C,G,Ns] of the queries at positions first .. first + C - 1 (q [B,C,H,D]), with gradient: p_cmp over
    the compressed tokens each sees, mapped onto the selection blocks by `weights` (overlap_matrix, [Nc, Ns]; the
    Eq. 9 weights) and summed over each group's heads. selection_scores is this over every query, without
    gradient; the selection distillation (nsa.model.selection_distill) trains it at a few."""
    groups, num_cmp = k_cmp.shape[2], k_cmp.shape[1]
    allowed = _cmp_visible(first, first + q.shape[1], num_cmp, block_len, block_stride, q.device)
    p_cmp = _probs(_split_heads(q, groups), k_cmp, allowed, scale)  # [B,G,h,C,Nc]
    return (p_cmp @ weights).sum(2).permute(0, 2, 1, 3)  # [B,C,G,Ns]


def top_n_blocks(scores: torch.Tensor, *, sel_block: int, n_sel: int,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [B,T,G,n] (int64, ascending, unused slots -1) from scores [B,T,G,Ns].

    Candidates for query t are blocks j with j*l' <= t. Block 0, the block holding t
    and the one before it are always taken; the remaining places go to the highest
    scores, ties to the lower j (a stable descending sort keeps j order among equals).
    `positions` (broadcastable to scores[..., :1]) gives each row's t; by default row i of
    dimension 1 is position i. Decoding passes one position per sequence.
    """
    num_sel = scores.shape[-1]
    device = scores.device
    # [T,1,1] broadcasts over G, Ns
    t = torch.arange(scores.shape[1], device=device)[:, None, None] if positions is None else positions
    j = torch.arange(num_sel, device=device)
    j_t = t // sel_block
    candidate = j <= j_t
    forced = (j == 0) | (j == j_t) | (j == j_t - 1)
    key = torch.where(forced, torch.inf, scores)
    key = torch.where(candidate, key, -torch.inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :n_sel]
    chosen = torch.where(torch.gather(candidate.expand_as(key), -1, order), order, num_sel)
    chosen = chosen.sort(dim=-1).values  # ascending; the `num_sel` sentinels sort last
    chosen = torch.where(chosen == num_sel, -1, chosen)
    if chosen.shape[-1] < n_sel:
        pad = chosen.new_full((*chosen.shape[:-1], n_sel - chosen.shape[-1]), -1)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int | None = None,
    block_stride: int | None = None,
    sel_block: int | None = None,
    n_sel: int | None = None,
    scale: float | None = None,
    geometry: NSAGeometry | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selected block indices [B,T,G,n] (docs/design.md#top-n-selection); the geometry as four keywords or
    `geometry` (its window unused). With cu_seqlens, document-relative indices of each packed document
    (docs/design.md#packed-documents)."""
    geometry = geometry_from(geometry, block_len=block_len, block_stride=block_stride, sel_block=sel_block,
                             n_sel=n_sel)
    if cu_seqlens is not None:
        return _per_document(lambda q, k_cmp: select_blocks(q, k_cmp, geometry=geometry, scale=scale),
                             cu_seqlens, geometry, {"q": q}, {"k_cmp": k_cmp})
    scores = selection_scores(q, k_cmp, block_len=geometry.block_len, block_stride=geometry.block_stride,
                              sel_block=geometry.sel_block, scale=scale)
    return top_n_blocks(scores, sel_block=geometry.sel_block, n_sel=geometry.n_sel)


# ---------------------------------------------------------------- selected branch


def _selected_mask(c0: int, c1: int, idx: torch.Tensor, sel_block: int) -> torch.Tensor:
    """[B,G,C,c1] bool: key s <= t lies in one of query t's selected blocks (idx [B,C,G,n])."""
    num_sel = num_selection_blocks(c1, sel_block)
    # One-hot over num_sel + 1 classes so that the -1 padding lands in a discarded column.
    slot = torch.where((idx >= 0) & (idx < num_sel), idx, num_sel)
    chosen = torch.nn.functional.one_hot(slot, num_sel + 1)[..., :num_sel].any(-2)  # [B,C,G,Ns]
    s = torch.arange(c1, device=idx.device)
    t = torch.arange(c0, c1, device=idx.device)
    in_block = chosen[..., s // sel_block]  # [B,C,G,S]
    causal = (s[None, :] <= t[:, None])[None, :, None, :]
    return (in_block & causal).permute(0, 2, 1, 3)


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    sel_block: int,
    scale: float | None = None,
) -> torch.Tensor:
    """o_sel [B,T,H,Dv]: attention over tokens s <= t inside the selected blocks of t's group."""
    scale = _default_scale(q, scale)
    dtype = _compute_dtype(q, k, v)
    groups = k.shape[2]

    def chunk(c0, c1, qc, k, v, idx):
        allowed = _selected_mask(c0, c1, idx[:, c0:c1], sel_block)
        return _attend(_split_heads(qc, groups), k[:, :c1], v[:, :c1], allowed, scale)

    out = _over_query_chunks(chunk, q.to(dtype), k.to(dtype), v.to(dtype), indices)
    return out.to(q.dtype)


# ---------------------------------------------------------------- window branch


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    scale: float | None = None,
) -> torch.Tensor:
    """o_win [B,T,H,Dv]: attention over tokens s in [max(0, t-w+1), t]."""
    scale = _default_scale(q, scale)
    dtype = _compute_dtype(q, k, v)
    groups = k.shape[2]

    def chunk(c0, c1, qc, k, v):
        k0 = max(0, c0 - window + 1)
        s = torch.arange(k0, c1, device=qc.device)
        t = torch.arange(c0, c1, device=qc.device)[:, None]
        allowed = ((s <= t) & (s > t - window))[None, None]
        return _attend(_split_heads(qc, groups), k[:, k0:c1], v[:, k0:c1], allowed, scale)

    out = _over_query_chunks(chunk, q.to(dtype), k.to(dtype), v.to(dtype))
    return out.to(q.dtype)


# ---------------------------------------------------------------- all branches


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    block_len: int | None = None,
    block_stride: int | None = None,
    sel_block: int | None = None,
    n_sel: int | None = None,
    window: int | None = None,
    scale: float | None = None,
    indices: torch.Tensor | None = None,
    geometry: NSAGeometry | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B,T,H,Dv] = sum over branches c of gates[..., c] * o_c (docs/design.md#gates-and-output).

    The geometry comes as the five keywords or as `geometry`. `indices` replaces the selection (e.g. to check a
    fast path's output on its own choice of near-tied blocks); by default the blocks are selected as the contract
    says. With cu_seqlens, q and the raw keys/values are [1, total, ...] and each packed document is its own
    sequence (docs/design.md#packed-documents).
    """
    geometry = geometry_from(geometry, block_len=block_len, block_stride=block_stride, sel_block=sel_block,
                             n_sel=n_sel, window=window)
    check_nsa_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, geometry, cu_seqlens)
    if cu_seqlens is not None:
        raw = {"q": q, "k_sel": k_sel, "v_sel": v_sel, "k_win": k_win, "v_win": v_win, "gates": gates}
        if indices is not None:
            raw["indices"] = indices
        return _per_document(partial(nsa_attention, geometry=geometry, scale=scale), cu_seqlens, geometry, raw,
                             {"k_cmp": k_cmp, "v_cmp": v_cmp})
    out_dtype = q.dtype
    if q.shape[1] == 0:  # empty sequence: an empty output, still connected to every input
        tie = sum(t.sum() for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))
        return q.new_zeros(*q.shape[:-1], v_sel.shape[-1]) + 0 * tie.to(out_dtype)
    dtype = _compute_dtype(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = (
        t.to(dtype) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    )
    if indices is None:
        indices = select_blocks(q, k_cmp, geometry=geometry, scale=scale)
    o_cmp = compressed_attention(q, k_cmp, v_cmp, block_len=geometry.block_len, block_stride=geometry.block_stride,
                                 scale=scale)
    o_sel = selected_attention(q, k_sel, v_sel, indices, sel_block=geometry.sel_block, scale=scale)
    o_win = window_attention(q, k_win, v_win, window=geometry.window, scale=scale)
    g = gates.unsqueeze(-1)
    return (g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win).to(out_dtype)


# ---------------------------------------------------------------- packed documents


def _per_document(fn, cu_seqlens: torch.Tensor, geometry: NSAGeometry, raw: dict[str, torch.Tensor],
                  compressed: dict[str, torch.Tensor]) -> torch.Tensor:
    """fn(**tensors) run on each packed document alone, the outputs concatenated along the tokens: the definition
    of the packed ops (docs/design.md#packed-documents). `raw` tensors are [1, total, ...] and are cut at the
    document's tokens, `compressed` ones [1, C, ...] at its compressed rows."""
    total = next(iter(raw.values())).shape[1]
    document_bounds(cu_seqlens, total)  # checks the boundaries
    bounds = cu_seqlens.tolist()
    offsets = compressed_offsets(cu_seqlens, geometry).tolist()
    documents = [(doc, start, end) for doc, (start, end) in enumerate(zip(bounds, bounds[1:])) if end > start]
    if not documents:  # no token at all: the unpacked op's empty output, still connected to every input
        return fn(**{name: t[:, :0] for name, t in (raw | compressed).items()})
    # Documents of one length run as one batch of the unpacked op (each row its own sequence): the same result
    # as one call each, in far fewer calls where windows hold whole documents.
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for document in documents:
        by_length.setdefault(document[2] - document[1], []).append(document)
    pieces: dict[int, torch.Tensor] = {}
    for same in by_length.values():
        tensors = {name: torch.cat([t[:, start:end] for _, start, end in same]) for name, t in raw.items()}
        tensors |= {name: torch.cat([t[:, offsets[doc]:offsets[doc + 1]] for doc, _, _ in same])
                    for name, t in compressed.items()}
        for (doc, _, _), out in zip(same, fn(**tensors).split(1)):
            pieces[doc] = out
    return torch.cat([pieces[doc] for doc, _, _ in documents], dim=1)
