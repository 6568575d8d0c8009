"""No output at t may depend on any input at a position > t, through any branch or the selection."""

import dataclasses

import torch

from helpers import nsa_inputs
from nsa.model import NSAAttention, Transformer, tiny
from nsa.model.rope import RotaryEmbedding
from nsa.ops import nsa_attention, select_blocks
from nsa.ops.geometry import compressed_block_ends

HP = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)


def perturb_future(inputs, t0):
    """New random values for every input position after t0 (compressed tokens not yet visible at t0)."""
    out = [x.clone() for x in inputs]
    future_cmp = compressed_block_ends(inputs[1].shape[1], HP["block_len"], HP["block_stride"]) > t0
    for i, x in enumerate(out):
        mask = future_cmp if i in (1, 2) else torch.arange(x.shape[1]) > t0
        x[:, mask] = torch.randn_like(x[:, mask]) * 3
    return out


def test_future_inputs_change_no_earlier_output_or_selection():
    inputs = nsa_inputs(2, 70, 6, 2, 8, 8, block_len=8, block_stride=4, seed=2)
    base = nsa_attention(*inputs, **HP)
    base_idx = select_blocks(inputs[0], inputs[1], **{k: HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")})
    for t0 in (0, 6, 7, 30, 41, 68):
        changed = perturb_future(inputs, t0)
        out = nsa_attention(*changed, **HP)
        idx = select_blocks(changed[0], changed[1], **{k: HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")})
        torch.testing.assert_close(out[:, : t0 + 1], base[:, : t0 + 1], rtol=0, atol=0)
        assert torch.equal(idx[:, : t0 + 1], base_idx[:, : t0 + 1])
        assert not torch.allclose(out[:, t0 + 1 :], base[:, t0 + 1 :]), "the perturbation must matter later"


def test_each_branch_alone_is_causal():
    inputs = nsa_inputs(1, 50, 4, 2, 8, 8, block_len=8, block_stride=4, seed=4)
    for branch in range(3):
        gates = torch.zeros_like(inputs[7])
        gates[..., branch] = 1.0
        only = inputs[:7] + [gates]
        base = nsa_attention(*only, **HP)
        for t0 in (9, 25, 47):
            changed = perturb_future(only, t0)
            changed[7] = gates
            torch.testing.assert_close(nsa_attention(*changed, **HP)[:, : t0 + 1], base[:, : t0 + 1], rtol=0, atol=0)


def test_layer_and_model_are_causal_including_compression_and_gates():
    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny(), vocab_size=64, n_layers=2)
    model = Transformer(cfg).double()
    # Randomise every weight, zero-initialised phi layers included, so that no path is trivially inactive.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    tokens = torch.randint(0, 64, (2, 90))
    base = model(tokens)
    layer = model.layers[0].attn
    assert isinstance(layer, NSAAttention)
    x = torch.randn(2, 90, cfg.dim, dtype=torch.float64)
    cos, sin = RotaryEmbedding(cfg.head_dim)(torch.arange(90))
    layer_base = layer(x, cos, sin)
    for t0 in (3, 15, 16, 50, 88):
        changed = tokens.clone()
        changed[:, t0 + 1 :] = torch.randint(0, 64, changed[:, t0 + 1 :].shape)
        torch.testing.assert_close(model(changed)[:, : t0 + 1], base[:, : t0 + 1], rtol=0, atol=0)
        x2 = x.clone()
        x2[:, t0 + 1 :] += torch.randn_like(x2[:, t0 + 1 :])
        torch.testing.assert_close(layer(x2, cos, sin)[:, : t0 + 1], layer_base[:, : t0 + 1], rtol=0, atol=0)
