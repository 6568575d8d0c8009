"""NSA health statistics: gate and selection sums from a no-grad probe forward on logging steps.

`probe` walks the raw (uncompiled, unwrapped) modules layer by layer over a small token slice,
so what it measures does not depend on torch.compile, activation checkpointing or autograd, and
it never syncs with the host. It returns *sums* (float64 / int64, one row per layer, the same
shapes on every rank for a given model and slice length) so the caller can `all_reduce` each
tensor across ranks; `summarize` then turns the summed tensors into the JSON record.

Definitions (per layer; a "slot" is one valid entry of the selection indices [B,T,G,n]):
- gate shares: g[t,h,:] / sum_c g[t,h,c]; entropy in nats, at most ln 3.
- distance of a chosen block j for query t: t - j * sel_block, in tokens (the block's start).
- forced blocks (docs/design.md#top-n-selection): block 0, the block holding t and the one before it.
- concentration: mean, over non-forced slots (t, j), of the share of the queries of t's span that
  also chose j as a non-forced block; spans are the selection blocks of the queries (queries of one
  span share their candidate and forced blocks), per batch row and kv group. In (0, 1]; 1 means
  every query of a span picked the same blocks.
- selection KL: the mean KL divergence, at the slice's last model.nsa.selection_distill_queries queries, from
  where the selected branch's keys would attend over the whole context to the block scores top-n ranks
  (nsa.model.selection_distill; 0 when the scores rank the blocks as that attention weighs them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..model.attention import NSAAttention
from ..model.selection_distill import selection_kl_sum
from ..ops.geometry import num_selection_blocks


def distance_edges(sel_block: int, seq_len: int) -> list[int]:
    """Histogram edges [0, l', 2l', 4l', ...] in tokens; the last is >= seq_len, so every distance (< T) has a bin."""
    edges = [0, sel_block]
    while edges[-1] < seq_len:
        edges.append(2 * edges[-1])
    return edges


def _unwrap(module: nn.Module) -> nn.Module:
    """The module under DDP, checkpoint and torch.compile wrappers: their __call__ must not run in the probe."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_checkpoint_wrapped_module"):
            module = module._checkpoint_wrapped_module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


@contextlib.contextmanager
def _unsharded(module: nn.Module) -> Iterator[None]:
    """Full parameters while used. For an FSDP2 module this all-gathers: a collective every rank must join."""
    if not (callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def _gate_sums(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    per_head = gates.detach().to(torch.float64).flatten(0, -3)  # [tokens, heads, 3]
    g = per_head.flatten(0, 1)  # [(token, head) samples, 3]
    shares = g / g.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return {
        # torch.full launches a fill kernel; torch.tensor(...) on CUDA would copy from the host and sync.
        "gate_count": torch.full((), g.shape[0], dtype=torch.int64, device=g.device),
        "gate_sum": g.sum(0),
        "gate_head_sum": per_head.sum(0),
        "gate_sq_sum": g.square().sum(0),
        "gate_entropy_sum": -torch.xlogy(shares, shares).sum(),
    }


def _concentration_sum(idx: torch.Tensor, free: torch.Tensor, sel_block: int) -> torch.Tensor:
    """Numerator of the concentration: sum over spans and blocks of count^2 / span size (see module docstring)."""
    b, seq_len, groups, _ = idx.shape
    ns = num_selection_blocks(seq_len, sel_block)  # both the number of spans and of blocks
    dev = idx.device
    span = torch.arange(seq_len, device=dev) // sel_block
    row = (torch.arange(b, device=dev).view(b, 1, 1, 1) * ns + span.view(1, -1, 1, 1)) * groups
    row = row + torch.arange(groups, device=dev).view(1, 1, groups, 1)
    # Column ns collects the forced and unused slots, so scatter needs no boolean indexing (a host sync).
    flat = row * (ns + 1) + torch.where(free, idx, ns)
    counts = torch.zeros(b * ns * groups * (ns + 1), dtype=torch.float64, device=dev)
    counts.scatter_add_(0, flat.flatten(), torch.ones_like(flat, dtype=torch.float64).flatten())
    counts = counts.view(b, ns, groups, ns + 1)[..., :ns]
    sizes = (seq_len - torch.arange(ns, device=dev) * sel_block).clamp(max=sel_block).to(torch.float64)
    return (counts.square() / sizes.view(1, ns, 1, 1)).sum()


def selection_sums(idx: torch.Tensor, sel_block: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Slot count, distance sum, forced count, concentration numerator and distance histogram of indices [B,T,G,n]."""
    t = torch.arange(idx.shape[1], device=idx.device).view(1, -1, 1, 1)
    j_t = t // sel_block
    valid = idx >= 0
    forced = valid & ((idx == 0) | (idx == j_t) | (idx == j_t - 1))
    dist = torch.where(valid, t - idx * sel_block, 0)
    n_bins = len(distance_edges(sel_block, seq_len)) - 1
    inner_edges = sel_block * 2 ** torch.arange(n_bins - 1, device=idx.device)  # edges[1:-1], built on device
    bins = torch.bucketize(dist, inner_edges, right=True)
    hist = torch.zeros(n_bins, dtype=torch.int64, device=idx.device)
    hist.scatter_add_(0, bins.flatten(), valid.flatten().to(torch.int64))  # unused slots add 0
    return {
        "sel_count": valid.sum(),
        "sel_distance_sum": dist.sum(),
        "sel_forced_count": forced.sum(),
        "sel_concentration_sum": _concentration_sum(idx, valid & ~forced, sel_block),
        "distance_counts": hist,
    }


def _layer_sums(attn: NSAAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, torch.Tensor]:
    p = attn.project(x, cos, sin)
    idx = attn.selected_blocks(p)
    return {**_gate_sums(p["gates"]), **selection_sums(idx, attn.geometry.sel_block, x.shape[1]),
            **_agreement_sums(attn, p)}


def _agreement_sums(attn: NSAAttention, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum and count of the selection distillation's KL terms (nsa.model.selection_distill) at the slice's last
    model.nsa.selection_distill_queries queries: how far the blocks' scores are from where the selected branch's
    own keys would attend, whether or not the distillation trains them."""
    total, count = selection_kl_sum(p["q"], attn.compress_k(p["k_cmp"]), p["k_sel"], attn.geometry,
                                    attn.cfg.nsa.selection_distill_queries)
    return {"sel_kl_sum": total.to(torch.float64),
            "sel_kl_count": torch.full((), count, dtype=torch.int64, device=total.device)}


@torch.no_grad()
def probe(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Per-layer NSA statistic sums from a no-grad forward of tokens [b, T]; None for a dense model.

    Keys (L = number of layers, H = query heads, K = len(distance_edges(sel_block, T)) - 1): gate_count [L]
    int64 ((token, head) samples), gate_sum / gate_sq_sum [L, 3] float64 (cmp, sel, win), gate_head_sum [L, H, 3]
    float64 (per head, over tokens), gate_entropy_sum [L] float64, sel_count / sel_distance_sum /
    sel_forced_count [L] int64, sel_concentration_sum [L] float64, sel_kl_sum [L] float64 / sel_kl_count [L]
    int64 (the selection distillation's KL terms), distance_counts [L, K] int64. Nothing is copied to the host.

    Accepts the model as trained: bare, DDP, checkpoint-wrapped and compiled blocks, FSDP2. Under FSDP2
    every rank must call probe at the same step (each block's parameters are all-gathered while it is
    used), between optimizer steps (not between a forward and its backward). Runs under the caller's
    autocast; every layer must be NSA when any is.
    """
    root = _unwrap(model)
    blocks = list(root.layers)
    inners = [_unwrap(block) for block in blocks]
    if not any(isinstance(inner.attn, NSAAttention) for inner in inners):
        return None
    with _unsharded(root):
        cos, sin = root.rope(torch.arange(tokens.shape[1], device=tokens.device))
        x = root.tok_emb(tokens)
    per_layer = []
    for block, inner in zip(blocks, inners):
        with _unsharded(block), _evaluating(inner):
            per_layer.append(_layer_sums(inner.attn, inner.attn_norm(x), cos, sin))
            # inner.forward, not block(...): the block's __call__ is the compiled / checkpointed / FSDP one.
            x = inner.forward(x, cos, sin)
    return {key: torch.stack([sums[key] for sums in per_layer]) for key in per_layer[0]}


@contextlib.contextmanager
def _evaluating(module: nn.Module):
    """The module in eval mode for the probe, then back: the probe reads the model whole (no model.attention_drop)
    and draws nothing from the random generator, whose state a resumed run restores."""
    was_training = module.training
    module.train(False)
    try:
        yield
    finally:
        module.train(was_training)


def _ratio(num: float, den: float) -> float | None:
    # None becomes JSON null, which the report reads as "not measured" (no NaN in JSON).
    return num / den if den > 0 else None


def summarize(sums: dict[str, torch.Tensor], edges: list[int] | list[float]) -> dict[str, Any]:
    """JSON-ready record from (cross-rank summed) probe sums and distance_edges(sel_block, T); caller adds "step"."""
    s = {key: value.detach().cpu() for key, value in sums.items()}
    layers = []
    for i in range(s["gate_count"].shape[0]):
        n = float(s["gate_count"][i])
        mean = s["gate_sum"][i].double() / max(n, 1.0)
        var = (s["gate_sq_sum"][i].double() / max(n, 1.0) - mean.square()).clamp_min(0.0)
        head_sums = s["gate_head_sum"][i].double()  # [H, 3]; every head sees n / H samples
        head_means = head_sums / max(n / head_sums.shape[0], 1.0)
        count, forced = int(s["sel_count"][i]), int(s["sel_forced_count"][i])
        layers.append({
            "layer": i,
            "gate_mean": mean.tolist(),
            "gate_std": var.sqrt().tolist(),
            # What model.nsa.gate_floor acts on: a head's gate averaged over the tokens, here the lowest head's.
            "gate_head_min": head_means.min(0).values.tolist(),
            "gate_entropy": _ratio(float(s["gate_entropy_sum"][i]), n),
            "sel_distance_mean": _ratio(float(s["sel_distance_sum"][i]), count),
            "sel_forced_share": _ratio(forced, count),
            "sel_concentration": _ratio(float(s["sel_concentration_sum"][i]), count - forced),
            "sel_kl": _ratio(float(s["sel_kl_sum"][i]), float(s["sel_kl_count"][i])),
        })
    counts = s["distance_counts"]
    return {
        "layers": layers,
        "distance_edges": [float(e) for e in edges],
        "distance_counts": [[int(c) for c in row] for row in counts.round().to(torch.int64).tolist()],
    }
