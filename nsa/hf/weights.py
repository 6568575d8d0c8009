"""Weight names between the nsa Transformer and Hugging Face checkpoints.

NSA models keep the Transformer's own names under `model.` (NSAForCausalLM wraps the Transformer). A dense model
maps onto LlamaForCausalLM (docs/interop.md): the fused key/value and gate/up projections split in two, the
output head is tied to the embedding and not stored.
"""

from __future__ import annotations

import re

import torch

from ..model.config import ModelConfig

NSA_PREFIX = "model."

_LLAMA_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
"""nsa name -> Llama name of the weights that map one to one (per layer under model.layers.N. for block ones)."""

_LLAMA_PAIRS = {
    "attn.wkv.weight": ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),  # wkv rows: keys, then values
    "mlp.w_gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),  # w_gate_up rows: gate, then up
}
"""nsa fused weight -> the two Llama weights its rows split into, in order."""

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def nsa_to_hf(state: dict[str, torch.Tensor], dense: bool) -> dict[str, torch.Tensor]:
    """The Hugging Face checkpoint's tensors of a Transformer's state dict (tied output head left out)."""
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    if not dense:
        return {NSA_PREFIX + k: v.contiguous() for k, v in state.items()}
    out = {}
    for name, tensor in state.items():
        layer = _LAYER.fullmatch(name)
        prefix, key = (f"model.layers.{layer[1]}.", layer[2]) if layer else ("", name)
        if key in _LLAMA_PAIRS:
            first, second = tensor.chunk(2, dim=0)
            out[prefix + _LLAMA_PAIRS[key][0]] = first.contiguous()
            out[prefix + _LLAMA_PAIRS[key][1]] = second.contiguous()
        else:
            out[prefix + _LLAMA_NAMES[key]] = tensor.contiguous()
    return out


def hf_to_nsa(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Transformer state dict (output head included, tied) from a Hugging Face checkpoint's tensors."""
    if cfg.attention == "nsa":
        state = {k.removeprefix(NSA_PREFIX): v for k, v in tensors.items()}
    else:
        state = {}
        for key, hf in _LLAMA_NAMES.items():
            for name in _names(key, hf, cfg.n_layers):
                if name[1] in tensors:
                    state[name[0]] = tensors[name[1]]
        for key, (first, second) in _LLAMA_PAIRS.items():
            for i in range(cfg.n_layers):
                parts = [tensors.get(f"model.layers.{i}.{hf}") for hf in (first, second)]
                if all(p is not None for p in parts):
                    state[f"layers.{i}.{key}"] = torch.cat(parts)
    if "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def _names(key: str, hf: str, n_layers: int) -> list[tuple[str, str]]:
    """(nsa name, Llama name) of a one-to-one weight: once for a model weight, per layer for a block weight."""
    if hf.startswith("model."):
        return [(key, hf)]
    return [(f"layers.{i}.{key}", f"model.layers.{i}.{hf}") for i in range(n_layers)]
