"""Decode-time fused weights: fewer, larger matmuls for a step that is bound by kernel launches.

At batch 1 to 16 a decode step's matmuls are tiny, so their count, not their FLOPs, sets the time.
A layer's input goes through one matmul for all of its linear maps (queries, keys/values and, for
NSA, the gate's first layer), and phi's MLP runs on the new key block and value block together as
one batched matmul per MLP layer. The weights are a snapshot taken when the cache is built: load a
checkpoint before `new_cache`, not after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.attention import gates_from_logits


@dataclass
class FusedWeights:
    w_in: torch.Tensor
    """[sum(widths), dim]: the layer's input maps stacked by output rows."""
    widths: tuple[int, ...]
    """Output width of each input map, in the order the attention module lists them."""
    phi_pos: torch.Tensor | None = None
    """[2, l, D]: phi's intra-block position embedding for keys and values (None: phi is the mean)."""
    phi_fc1: torch.Tensor | None = None
    """[2, l*D, hidden]: phi's first layer for keys and values, transposed for bmm."""
    phi_fc2: torch.Tensor | None = None
    """[2, hidden, D]: phi's second layer, transposed."""
    gate_out: torch.Tensor | None = None
    """[hidden, 3H], at least float32: the gate MLP's second layer, transposed (None: a linear gate, all in w_in)."""


def fuse(layers: tuple[nn.Linear, ...], compressors: tuple[nn.Module, nn.Module] | None = None,
         gate: nn.Module | None = None) -> FusedWeights:
    """Stack the input maps (bias-free linears reading the same input) and, with phi='mlp', both compressors;
    keep the gate MLP's second layer (if it has one) for gates_from."""
    fused = FusedWeights(torch.cat([layer.weight.detach() for layer in layers]),
                         tuple(layer.out_features for layer in layers))
    if gate is not None and gate.fc1 is not None:
        w = gate.fc2.weight.detach()
        fused.gate_out = w.t().to(torch.promote_types(w.dtype, torch.float32)).contiguous()
    if compressors is not None and compressors[0].kind == "mlp":
        k, v = compressors
        fused.phi_pos = torch.stack([k.pos.detach(), v.pos.detach()])
        fused.phi_fc1 = torch.stack([k.fc1.weight.detach().t(), v.fc1.weight.detach().t()]).contiguous()
        fused.phi_fc2 = torch.stack([k.fc2.weight.detach().t(), v.fc2.weight.detach().t()]).contiguous()
    return fused


def input_rows(fused: FusedWeights, x: torch.Tensor) -> torch.Tensor:
    """Every input map of x [..., dim], side by side [..., sum(widths)]: one matmul."""
    return F.linear(x, fused.w_in)


def input_projections(fused: FusedWeights, x: torch.Tensor) -> list[torch.Tensor]:
    """Each input map of x [..., dim], from one matmul."""
    return list(input_rows(fused, x).split(fused.widths, dim=-1))


def gates_from(fused: FusedWeights, gate: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """GateMLP.finish(h) in at least float32, its second layer as a product and a sum over the hidden units: torch.compile
    fuses that with the SiLU and the sigmoid into one kernel, where a matmul this small would be a launch of its
    own (at decode batch sizes the launches, not the arithmetic, set a step's time)."""
    if fused.gate_out is None:
        return gate.finish(h)
    logits = (F.silu(h.to(fused.gate_out.dtype))[..., :, None] * fused.gate_out).sum(-2)
    return gates_from_logits(logits.view(*h.shape[:-1], gate.n_heads, -1), gate.kind)


def compress_pair(fused: FusedWeights, blocks: torch.Tensor) -> torch.Tensor:
    """phi of one block of keys and one of values, blocks [2, B, l, G, D] -> [2, B, G, D].

    The same function as BlockCompressor on a block of l tokens: the mean, plus with phi='mlp' the MLP
    of the flattened block (token-major) plus the position embedding.
    """
    mean = blocks.mean(dim=2)
    if fused.phi_fc1 is None:
        return mean
    two, b, l, g, d = blocks.shape
    flat = (blocks + fused.phi_pos[:, None, :, None, :]).permute(0, 1, 3, 2, 4).reshape(two, b * g, l * d)
    out = torch.bmm(F.silu(torch.bmm(flat, fused.phi_fc1)), fused.phi_fc2)
    return mean + out.view(two, b, g, d)
