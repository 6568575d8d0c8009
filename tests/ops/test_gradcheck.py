"""Finite-difference gradient checks in float64: every tensor input of nsa_attention, and the layer."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

from helpers import nsa_inputs
from nsa.model import NSAAttention, tiny
from nsa.model.rope import RotaryEmbedding
from nsa.ops import nsa_attention


@pytest.mark.parametrize(
    "B,T,H,G,l,d,lp,n,w",
    [
        (1, 13, 4, 2, 4, 2, 4, 3, 5),  # sparse selection: 4 blocks, 3 chosen
        (2, 6, 2, 1, 8, 4, 8, 3, 3),  # T shorter than a compression block: empty k_cmp
        (1, 11, 3, 3, 3, 3, 6, 3, 4),  # group size 1, odd T
    ],
)
def test_gradcheck_nsa_attention_every_input(B, T, H, G, l, d, lp, n, w):
    inputs = nsa_inputs(B, T, H, G, 3, 2, block_len=l, block_stride=d, dtype=torch.float64, seed=7, requires_grad=True)

    def fn(*xs):
        return nsa_attention(*xs, block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("phi,shared_kv,gate_hidden", [("mlp", False, 6), ("mean", True, 0)])
def test_gradcheck_nsa_layer_including_phi_and_gates(phi, shared_kv, gate_hidden):
    base = tiny()
    cfg = dataclasses.replace(
        base,
        dim=8,
        n_heads=4,
        n_kv_heads=2,
        head_dim=4,
        nsa=dataclasses.replace(
            base.nsa, block_len=4, block_stride=2, sel_block=4, n_sel=3, window=3, phi=phi, phi_hidden=5,
            gate_hidden=gate_hidden, shared_kv=shared_kv,
        ),
    )
    torch.manual_seed(0)
    layer = NSAAttention(cfg).double()
    params = {name: (torch.randn_like(p) * 0.5).requires_grad_(True) for name, p in layer.named_parameters()}
    names = list(params)
    T = 11
    x = torch.randn(1, T, cfg.dim, dtype=torch.float64, requires_grad=True)
    cos, sin = RotaryEmbedding(cfg.head_dim)(torch.arange(T))

    def fn(x, *ps):
        return functional_call(layer, dict(zip(names, ps)), (x, cos, sin))

    assert torch.autograd.gradcheck(fn, (x, *params.values()), eps=1e-6, atol=1e-6)
    if phi == "mlp":
        assert {"compress_k.fc2.weight", "compress_v.pos", "gate.fc1.weight"} <= set(names)
    if gate_hidden == 0:  # the linear gate reads the layer input directly
        assert "gate.fc1.weight" not in names and params["gate.fc2.weight"].shape == (4 * 3, cfg.dim)
