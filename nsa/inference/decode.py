"""Cached decoding: `prefill` runs the prompt and fills the caches, `decode_step` adds one token.

Both walk the Transformer's own modules (embedding, blocks' attn_norm / attn / mlp_norm / mlp,
final norm, lm_head) and repeat the attention layers' forward math around the cache, so a
decoded token's logits equal the full forward's at its position (tests/inference/test_decode.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..model.attention import NSAAttention
from ..model.rope import apply_rope
from ..ops import nsa_attention
from .attention import decode_attention, dense_decode_attention
from .cache import DecodeCache, DenseLayerCache, NSALayerCache
from .fused import FusedWeights, gates_from, input_projections


def _nsa_prefill(attn: NSAAttention, x, cos, sin, cache: NSALayerCache, lengths) -> torch.Tensor:
    # NSAAttention.forward, keeping the projections and the compressed stream.
    b, t, _ = x.shape
    p = attn.project(x, cos, sin)
    k_cmp, v_cmp = attn.compress_k(p["k_cmp"]), attn.compress_v(p["v_cmp"])
    cache.fill(p, k_cmp, v_cmp, lengths)
    o = nsa_attention(p["q"], k_cmp, v_cmp, p["k_sel"], p["v_sel"], p["k_win"], p["v_win"],
                      p["gates"].to(p["q"].dtype), geometry=attn.geometry, backend=attn.cfg.nsa.backend)
    return attn.wo(o.reshape(b, t, -1))


def _nsa_step(attn: NSAAttention, x, cos, sin, cache: NSALayerCache, positions, emit: bool = True) -> torch.Tensor:
    q_lin, kv_lin, gate_lin = input_projections(cache.fused, x)
    p = attn.project_from(q_lin, kv_lin, gate_lin, cos, sin, gates=gates_from(cache.fused, attn.gate, gate_lin))
    cache.write(p, positions)
    if emit:  # skipped (exactly: it would change nothing) when the host knows no block is due
        cache.emit(positions)  # before attending: a block ending at t is visible to t
    o, reads = decode_attention(p["q"][:, 0], p["gates"][:, 0].to(p["q"].dtype), cache, positions,
                                backend=attn.cfg.nsa.backend)
    cache.reads.copy_(reads)
    return attn.wo(o.flatten(1))[:, None]


def _dense_qkv(attn: nn.Module, x, cos, sin, fused: FusedWeights | None = None):
    # DenseAttention.forward's projections (from one matmul when given the fused weights).
    b, t, _ = x.shape
    q_lin, kv_lin = input_projections(fused, x) if fused is not None else (attn.wq(x), attn.wkv(x))
    q = apply_rope(q_lin.view(b, t, attn.n_heads, attn.head_dim), cos, sin)
    k, v = kv_lin.view(b, t, 2, attn.n_kv_heads, attn.head_dim).unbind(2)
    return q, apply_rope(k, cos, sin), v


def _dense_prefill(attn: nn.Module, x, cos, sin, cache: DenseLayerCache, lengths) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = _dense_qkv(attn, x, cos, sin)
    cache.fill(k, v)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return attn.wo(o.transpose(1, 2).reshape(b, t, -1))


def _dense_step(attn: nn.Module, x, cos, sin, cache: DenseLayerCache, positions, emit: bool = True) -> torch.Tensor:
    q, k, v = _dense_qkv(attn, x, cos, sin, cache.fused)
    cache.write(k, v, positions)
    o, reads = dense_decode_attention(q[:, 0], cache, positions)
    cache.reads.copy_(reads)
    return attn.wo(o.flatten(1))[:, None]


PREFILL_TOKENS = 131072
"""Most prompt tokens (rows x padded length) per prefill forward: a larger batch goes a few prompts at a
time (16 prompts of 128k tokens in one forward would ask for ~50 GB of selected-branch buffers)."""


def _prefill_blocks(model: nn.Module, x, cos, sin, layers: list, lengths) -> torch.Tensor:
    for block, layer_cache in zip(model.layers, layers):
        fill = _nsa_prefill if isinstance(block.attn, NSAAttention) else _dense_prefill
        x = x + fill(block.attn, block.attn_norm(x), cos, sin, layer_cache, lengths)
        x = x + block.mlp(block.mlp_norm(x))
    return x


@torch.no_grad()
def prefill(model: nn.Module, tokens: torch.Tensor, cache: DecodeCache,
            lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Run prompts tokens [B,T] through the model, fill the cache, return each prompt's last logits [B,V].

    Prompts of different lengths are right-padded into `tokens` with their lengths [B] given:
    causality keeps the padding out of every real position, and decoding overwrites it.
    """
    b, t = tokens.shape
    if b != cache.batch_size or t > cache.max_len or t < 1:
        raise ValueError(f"prompts [B={b}, T={t}] do not fit a cache of batch {cache.batch_size}, "
                         f"max_len {cache.max_len} (T must be 1..max_len)")
    lengths = torch.full((b,), t, device=tokens.device) if lengths is None else lengths.to(tokens.device).long()
    if lengths.min() < 1 or lengths.max() > t:
        raise ValueError(f"prompt lengths must lie in 1..{t}, got {lengths.tolist()}")
    cos, sin = model.rope(torch.arange(t, device=tokens.device))
    per_forward = max(1, PREFILL_TOKENS // t)
    logits = []
    for a in range(0, b, per_forward):
        z = min(b, a + per_forward)
        x = _prefill_blocks(model, model.tok_emb(tokens[a:z]), cos, sin, [c.rows(a, z) for c in cache.layers],
                            lengths[a:z])
        logits.append(model.lm_head(model.norm(x[torch.arange(z - a, device=x.device), lengths[a:z] - 1])))
    cache.lengths.copy_(lengths)
    cache.host_lengths = lengths.tolist()
    return torch.cat(logits)


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
