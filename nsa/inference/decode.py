"""Cached decoding: `prefill` runs the prompts and fills the caches, `decode_step` adds one token.

Both walk the Transformer's own modules (embedding, blocks' attn_norm / attn / mlp_norm / mlp,
final norm, lm_head) and repeat the attention layers' forward math around the cache, so a
decoded token's logits equal the full forward's at its position (tests/inference/test_decode.py).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn

from ..model.attention import NSAAttention, document_attention
from ..model.compression import compress_pair
from ..model.documents import Documents
from ..model.rope import apply_rope
from ..ops import nsa_attention
from ..ops.api import resolve_backend
from .attention import KERNEL_DTYPES, decode_attention, dense_decode_attention
from .cache import DecodeCache, DenseLayerCache, NSALayerCache
from .fused import FusedWeights, gates_from, input_projections, input_rows


def _nsa_prefill(attn: NSAAttention, x, cos, sin, cache: NSALayerCache, documents: Documents | None) -> torch.Tensor:
    # NSAAttention.forward, keeping the projections and the compressed stream; packed prompts are already the
    # one stream [1, total] that forward makes of packed documents.
    b, t, _ = x.shape
    cu_seqlens = None if documents is None else documents.cu_seqlens
    p = attn.project(x, cos, sin)
    k_cmp, v_cmp = compress_pair(attn.compress_k, attn.compress_v, p["k_cmp"], p["v_cmp"], cu_seqlens)
    cache.fill(p, k_cmp, v_cmp, documents)
    o = nsa_attention(p["q"], k_cmp, v_cmp, p["k_sel"], p["v_sel"], p["k_win"], p["v_win"],
                      p["gates"].to(p["q"].dtype), geometry=attn.geometry, backend=attn.cfg.nsa.backend,
                      cu_seqlens=cu_seqlens)
    return attn.wo(o.reshape(b, t, -1))


def _step_backend(attn: NSAAttention) -> str:
    """The NSA backend a decode step of this layer asks for (its decode attention's; the step's prep follows it)."""
    return attn.cfg.nsa.backend


def _nsa_prep(attn: NSAAttention, x, cos, sin, cache: NSALayerCache, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's queries [B,H,Dk] and gates [B,H,3] (in q's dtype) for x [B,1,dim]; writes the token's keys and
    values into the cache. In PyTorch: the reference for nsa.ops.triton.decode_prep."""
    q_lin, kv_lin, gate_lin = input_projections(cache.fused, x)
    p = attn.project_from(q_lin, kv_lin, gate_lin, cos, sin, gates=gates_from(cache.fused, attn.gate, gate_lin))
    cache.write(p, positions)
    return p["q"][:, 0], p["gates"][:, 0].to(p["q"].dtype)


def _nsa_prep_triton(attn: NSAAttention, x, cos, sin, cache: NSALayerCache,
                     positions) -> tuple[torch.Tensor, torch.Tensor]:
    """_nsa_prep with everything after the input GEMM in one Triton kernel (nsa.ops.triton.decode_prep)."""
    from ..ops.triton.decode_prep import decode_prep

    b = x.shape[0]
    return decode_prep(input_rows(cache.fused, x)[:, 0], positions, cos.reshape(b, -1), sin.reshape(b, -1),
                       cache.k, cache.v, cache.fused.gate_out, n_heads=attn.n_heads, gate_kind=attn.gate.kind)


def _prep_on_triton(backend: str, x: torch.Tensor) -> bool:
    """Whether the step's prep runs as the Triton kernel: where the decode attention does, for the dtypes the
    kernel computes exactly enough (float32 arithmetic: not for float64 models)."""
    return (x.dtype in KERNEL_DTYPES
            and resolve_backend(backend, x.device, seq_len=1) == "triton")


def _nsa_step(attn: NSAAttention, x, cos, sin, cache: NSALayerCache, positions, emit: bool = True) -> torch.Tensor:
    backend = _step_backend(attn)
    prep = _nsa_prep_triton if _prep_on_triton(backend, x) else _nsa_prep
    q, gates = prep(attn, x, cos, sin, cache, positions)
    if emit:  # skipped (exactly: it would change nothing) when the host knows no block is due
        cache.emit(positions)  # before attending: a block ending at t is visible to t
    o, _ = decode_attention(q, gates, cache, positions, backend=backend, reads_out=cache.reads)
    return attn.wo(o.flatten(1))[:, None]


def _dense_qkv(attn: nn.Module, x, cos, sin, fused: FusedWeights | None = None):
    # DenseAttention.forward's projections (from one matmul when given the fused weights).
    b, t, _ = x.shape
    q_lin, kv_lin = input_projections(fused, x) if fused is not None else (attn.wq(x), attn.wkv(x))
    q = apply_rope(q_lin.view(b, t, attn.n_heads, attn.head_dim), cos, sin)
    k, v = kv_lin.view(b, t, 2, attn.n_kv_heads, attn.head_dim).unbind(2)
    return q, apply_rope(k, cos, sin), v


def _dense_prefill(attn: nn.Module, x, cos, sin, cache: DenseLayerCache, documents: Documents | None) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = _dense_qkv(attn, x, cos, sin)
    cache.fill(k, v, documents)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if documents is None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        o = document_attention(q, k, v, documents)
    return attn.wo(o.transpose(1, 2).reshape(b, t, -1))


def _dense_step(attn: nn.Module, x, cos, sin, cache: DenseLayerCache, positions, emit: bool = True) -> torch.Tensor:
    q, k, v = _dense_qkv(attn, x, cos, sin, cache.fused)
    cache.write(k, v, positions)
    o, reads = dense_decode_attention(q[:, 0], cache, positions)
    cache.reads.copy_(reads)
    return attn.wo(o.flatten(1))[:, None]


PREFILL_TOKENS = 131072
"""Most prompt tokens per prefill forward: a larger batch goes a few prompts at a time (16 prompts of 128k tokens
in one forward would ask for ~50 GB of selected-branch buffers). A longer prompt goes alone."""


def _prefill_blocks(model: nn.Module, x, cos, sin, layers: list, documents: Documents | None) -> torch.Tensor:
    for block, layer_cache in zip(model.layers, layers):
        fill = _nsa_prefill if isinstance(block.attn, NSAAttention) else _dense_prefill
        x = x + fill(block.attn, block.attn_norm(x), cos, sin, layer_cache, documents)
        x = x + block.mlp(block.mlp_norm(x))
    return x


def _prompt_lengths(tokens: torch.Tensor, cache: DecodeCache, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Each prompt's length, after checking that the prompts fit the cache."""
    b, t = tokens.shape
    if cu_seqlens is None:
        lengths = [t] * b
    else:
        bounds = cu_seqlens.tolist()
        if b != 1 or cu_seqlens.dim() != 1 or bounds[0] != 0 or bounds[-1] != t:
            raise ValueError(f"packed prompts are tokens [1, total] with cu_seqlens [B+1] from 0 to total, got tokens "
                             f"{list(tokens.shape)} and cu_seqlens {bounds}")
        lengths = [stop - start for start, stop in itertools.pairwise(bounds)]
    if len(lengths) != cache.batch_size or not lengths or min(lengths) < 1 or max(lengths) > cache.max_len:
        raise ValueError(f"prompts of lengths {lengths} do not fit a cache of batch {cache.batch_size}, max_len "
                         f"{cache.max_len} (one prompt per sequence, each of 1..max_len tokens)")
    return lengths


def _forwards(lengths: list[int]) -> list[tuple[int, int]]:
    """Runs a..z-1 of consecutive prompts, one forward each, of at most PREFILL_TOKENS tokens unless one prompt is
    longer."""
    runs, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and size + n > PREFILL_TOKENS:
            runs.append((start, i))
            start, size = i, 0
        size += n
    return runs + [(start, len(lengths))]


@torch.no_grad()
def prefill(model: nn.Module, tokens: torch.Tensor, cache: DecodeCache,
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Run prompts through the model, fill the cache (prompt b in sequence b), return each prompt's last logits [B,V].

    tokens [B,T]: B prompts of T tokens. Prompts of different lengths come packed, with no padding: tokens
    [1, total] holding them back to back and cu_seqlens (int [B+1], docs/design.md#packed-documents) where prompt b
    is tokens cu_seqlens[b] .. cu_seqlens[b+1]-1. Each is its own document, so its logits and its cache equal
    those of its prefill alone.
    """
    lengths = _prompt_lengths(tokens, cache, cu_seqlens)
    starts = [0, *itertools.accumulate(lengths)]
    logits = []
    for a, z in _forwards(lengths):
        layers = [c.rows(a, z) for c in cache.layers]
        if cu_seqlens is None:
            logits.append(_prefill_rows(model, tokens[a:z], layers))
        else:
            logits.append(_prefill_packed(model, tokens[:, starts[a]:starts[z]], lengths[a:z], layers))
    cache.lengths.copy_(torch.tensor(lengths))
    cache.host_lengths = lengths
    return torch.cat(logits)


def _prefill_rows(model: nn.Module, tokens: torch.Tensor, layers: list) -> torch.Tensor:
    """Last logits [B,V] of B prompts of one length, tokens [B,T], filling the caches `layers` of B sequences."""
    cos, sin = model.rope(torch.arange(tokens.shape[1], device=tokens.device))
    x = _prefill_blocks(model, model.tok_emb(tokens), cos, sin, layers, None)
    return model.lm_head(model.norm(x[:, -1]))


def _prefill_packed(model: nn.Module, tokens: torch.Tensor, lengths: list[int], layers: list) -> torch.Tensor:
    """Last logits [B,V] of B packed prompts of these lengths, tokens [1,total], filling the caches `layers` of B
    sequences: one forward over packed documents, at document-relative positions."""
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=tokens.device)
    documents = Documents.from_cu_seqlens(cu_seqlens, 1, tokens.shape[1])
    cos, sin = model.rope(documents.positions)
    x = _prefill_blocks(model, model.tok_emb(tokens), cos, sin, layers, documents)
    return model.lm_head(model.norm(x[0, cu_seqlens[1:].long() - 1]))


def step_logits(model: nn.Module, token: torch.Tensor, layers: list, positions: torch.Tensor,
                 emit: bool = True) -> torch.Tensor:
    """The device work of one decode step (no host state), so that it can be compiled as a whole.

    emit=False leaves out the compressed emission (phi and its cache write): valid when no sequence's
    token completes a block (DecodeCache.emission_due), i.e. d - 1 steps in d for prompts of equal length.
    """
    cos, sin = model.rope(positions[:, None])  # [B,1,1,D/2]: each sequence at its own position
    x = model.tok_emb(token.view(-1, 1))
    for block, layer_cache in zip(model.layers, layers):
        step = _nsa_step if isinstance(block.attn, NSAAttention) else _dense_step
        x = x + step(block.attn, block.attn_norm(x), cos, sin, layer_cache, positions, emit)
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x[:, 0]))


def advance(cache: DecodeCache, run: Callable[[bool], torch.Tensor]) -> torch.Tensor:
    """One decode step: run(emit) does the device work (emit: whether some sequence completes a block, see
    step_logits) and returns the logits; then every position moves on, on the device and on the host."""
    if cache.longest >= cache.max_len:
        raise ValueError(f"the decode cache is full ({cache.max_len} tokens); allocate a larger max_len")
    logits = run(cache.emission_due())
    cache.lengths += 1
    cache.host_lengths = [n + 1 for n in cache.host_lengths]
    return logits


@torch.no_grad()
def decode_step(model: nn.Module, token: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
    """Append token [B] (one per sequence) at each sequence's next position; return its logits [B,V].

    On CUDA, GraphedDecoder (nsa.inference.graphed) runs the same step as one CUDA graph replay.
    """
    return advance(cache, lambda emit: step_logits(model, token, cache.layers, cache.lengths, emit))


def compiled_decode_step(model: nn.Module) -> Callable[[torch.Tensor, DecodeCache], torch.Tensor]:
    """decode_step(model, ., .) with the step's device work under torch.compile: the many small kernels
    of the projections, cache writes, compressed emission and MLPs fuse (the attention kernels stay as
    they are). Same results; the first call compiles."""
    body = torch.compile(step_logits, dynamic=False)

    @torch.no_grad()
    def step(token: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        return advance(cache, lambda emit: body(model, token, cache.layers, cache.lengths, emit))

    return step
