"""Attention of one new query per sequence over a decode cache: the NSA branches and the dense baseline.

`decode_attention` is the seam for a GPU decode kernel: same arguments, same results. It is
the contract of docs/design.md#decoding for a single query at position t (the math of
nsa.ops.reference, including its top-n tie-breaking), written with static shapes: every
tensor is sized by the cache's capacity and masked by position, so a step can be captured
in a CUDA graph. `reads` counts the key/value tokens behind the unmasked entries of what
was actually gathered, per sequence and key/value group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import reference
from ..ops.api import resolve_backend
from .cache import DenseLayerCache, NSALayerCache


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Query dtypes the Triton decode kernels take on a GPU (they compute in float32; float64 stays on the PyTorch
code there). Triton's CPU interpreter computes in NumPy and takes float64 too."""


def _use_triton(backend: str, q: torch.Tensor) -> bool:
    """Whether `backend` runs q's step on a Triton kernel: 'auto' on CUDA for KERNEL_DTYPES, or 'triton'."""
    if resolve_backend(backend, q.device, seq_len=1) != "triton":
        return False
    if q.dtype in KERNEL_DTYPES or not q.is_cuda:
        return True
    if backend == "triton":
        raise ValueError(f"the Triton decode kernels take float32, bfloat16 or float16 queries, got {q.dtype} on "
                         f"{q.device}; use backend='reference' (or 'auto')")
    return False


def _as_positions(positions: torch.Tensor | int, batch: int, device) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.full((batch,), positions, dtype=torch.long, device=device)
    return positions


def _masked_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `valid`; all-zero weights where nothing is valid."""
    if scores.shape[-1] == 0:  # a cache shorter than one compressed block has no compressed slot at all
        return scores
    s = scores.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    z = p.sum(-1, keepdim=True)
    return p / torch.where(z > 0, z, torch.ones_like(z))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B,G,h,D] against k [B,G,S,D] -> [B,G,h,S]."""
    return torch.einsum("bghd,bgsd->bghs", q, k) * scale


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B,L,G,D] at token indices idx [B,G,S] (per group) or [B,S] (shared) -> [B,G,S,D]."""
    rows = torch.arange(x.shape[0], device=x.device)
    if idx.dim() == 2:
        return x[rows[:, None], idx].transpose(1, 2)
    groups = torch.arange(x.shape[2], device=x.device)
    return x[rows[:, None, None], idx, groups[None, :, None]]


def _selection_scores(p_cmp: torch.Tensor, cache: NSALayerCache, num_sel: int) -> torch.Tensor:
    """Eq. 9 through the cache's band of overlaps, summed over each group's heads: [B,G,Ns]."""
    b, g = p_cmp.shape[:2]
    mass = p_cmp.sum(2)[..., None] * cache.sel_weight  # [B,G,Nc,K]
    index = cache.sel_index.flatten().expand(b, g, -1)
    s = mass.new_zeros(b, g, num_sel + 1).scatter_add_(-1, index, mass.flatten(-2))
    return s[..., :num_sel]


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).transpose(1, 2)  # [B,N,G,D] -> [B,G,N,D]


def _compressed(qg, cache: NSALayerCache, scale: float):
    """p_cmp [B,G,h,Nc], o_cmp [B,G,h,Dv] and the emitted-token mask [B,1,1,Nc]."""
    valid = (torch.arange(cache.k_cmp.shape[1], device=qg.device) < cache.n_cmp[:, None])[:, None, None]
    p = _masked_softmax(_scores(qg, _heads_first(cache.k_cmp, qg.dtype), scale), valid)
    return p, p @ _heads_first(cache.v_cmp, qg.dtype), valid


def _selected(qg, cache: NSALayerCache, chosen, t, sel_block: int, scale: float):
    """o_sel over the chosen blocks' tokens <= t, gathered per group; the gathered-token mask [B,G,n*l']."""
    max_len = cache.k.shape[2]
    tok = (chosen[..., None] * sel_block + torch.arange(sel_block, device=qg.device)).flatten(-2)
    valid = (chosen >= 0).repeat_interleave(sel_block, -1) & (tok <= t[:, None, None])
    tok = tok.clamp(0, max_len - 1)
    p = _masked_softmax(_scores(qg, _gather_tokens(cache.keys("sel"), tok).to(qg.dtype), scale), valid[:, :, None])
    return p @ _gather_tokens(cache.values("sel"), tok).to(qg.dtype), valid


def _window(qg, cache: NSALayerCache, t, window: int, scale: float):
    """o_win over the last min(w, t+1) tokens; the gathered-token mask [B,span]."""
    span = min(window, cache.k.shape[2])  # a window as long as the cache covers every position
    tok = t[:, None] - span + 1 + torch.arange(span, device=qg.device)
    valid = tok >= 0
    tok = tok.clamp_min(0)
    p = _masked_softmax(_scores(qg, _gather_tokens(cache.keys("win"), tok).to(qg.dtype), scale), valid[:, None, None])
    return p @ _gather_tokens(cache.values("win"), tok).to(qg.dtype), valid


def decode_attention(
    q: torch.Tensor,
    gates: torch.Tensor,
    cache: NSALayerCache,
    positions: torch.Tensor | int,
    *,
    scale: float | None = None,
    backend: str = "auto",
    reads_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA output o [B,H,Dv] of the queries q [B,H,Dk] at positions [B] (or one int for all), and
    reads [B,G]: key/value tokens gathered per sequence and group (compressed + selected + window), written into
    `reads_out` (int64 [B,G]) when given (a decode step's cache.reads: the kernel writes it, no copy follows).

    gates [B,H,3] in (cmp, sel, win) order, in [0, 1]. The cache must already hold every token up
    to and including t and the compressed tokens emitted at t; the geometry is the cache's (its compressed
    stream and overlap band were built with it). The chosen blocks are written to cache.selected [B,G,n].
    backend: 'auto' (the fused Triton kernel on CUDA, this PyTorch code elsewhere and for float64 on
    CUDA), 'reference' (this code) or 'triton'.
    """
    b, heads, dk = q.shape
    groups = cache.k.shape[3]
    geometry = cache.geometry
    scale = dk**-0.5 if scale is None else scale
    if _use_triton(backend, q):
        from ..ops.triton.decode import decode_attention_triton

        return decode_attention_triton(
            q, gates, cache.k_cmp, cache.v_cmp, cache.n_cmp, cache.keys("sel"), cache.values("sel"),
            cache.keys("win"), cache.values("win"), _as_positions(positions, b, q.device), geometry=geometry,
            scale=scale, selected=cache.selected, reads=reads_out)
    dtype = torch.promote_types(torch.promote_types(q.dtype, cache.k.dtype), torch.float32)
    t = _as_positions(positions, b, q.device)
    qg = q.to(dtype).view(b, groups, heads // groups, dk)

    p_cmp, o_cmp, cmp_valid = _compressed(qg, cache, scale)
    num_sel = geometry.num_selection_blocks(cache.k.shape[2])
    chosen = reference.top_n_blocks(_selection_scores(p_cmp, cache, num_sel), sel_block=geometry.sel_block,
                                    n_sel=geometry.n_sel, positions=t[:, None, None])
    cache.selected.copy_(chosen)
    o_sel, sel_valid = _selected(qg, cache, chosen, t, geometry.sel_block, scale)
    o_win, win_valid = _window(qg, cache, t, geometry.window, scale)

    g = gates.to(dtype).view(b, groups, heads // groups, 3, 1)
    o = g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win
    reads = cmp_valid.flatten(1).sum(-1, keepdim=True) + sel_valid.sum(-1) + win_valid.sum(-1, keepdim=True)
    if reads_out is not None:
        reads = reads_out.copy_(reads)
    return o.reshape(b, heads, -1).to(q.dtype), reads


def dense_decode_attention(
    q: torch.Tensor, cache: DenseLayerCache, positions: torch.Tensor | int, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention o [B,H,Dv] of q [B,H,Dk] over the cached tokens <= t; reads [B,G].

    backend: 'auto' (on CUDA the split-context Triton kernel, nsa.ops.triton.dense_decode; SDPA elsewhere and for
    float64 on CUDA), 'reference' (SDPA with the positions as a mask) or 'triton'.
    """
    b, groups = q.shape[0], cache.k.shape[2]
    t = _as_positions(positions, b, q.device)
    reads = (t + 1)[:, None].expand(b, groups)
    if _use_triton(backend, q):
        from ..ops.triton.dense_decode import dense_decode_triton

        return dense_decode_triton(q, cache.k, cache.v, t, q.shape[-1] ** -0.5), reads
    valid = torch.arange(cache.k.shape[1], device=q.device) <= t[:, None]  # [B,L]
    o = F.scaled_dot_product_attention(
        q[:, :, None], cache.k.transpose(1, 2), cache.v.transpose(1, 2),
        attn_mask=valid[:, None, None], enable_gqa=True,
    )
    return o[:, :, 0], reads
