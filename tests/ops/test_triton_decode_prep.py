"""The decode prep kernel (nsa.ops.triton.decode_prep) against the PyTorch step it replaces (decode._nsa_prep:
project_from, gates_from, NSALayerCache.write) on twin caches: q, gates and the whole raw caches, for sigmoid,
softmax and linear gates, shared and separate key/value sets, one sequence and three at different positions, in
float32 and bf16. Without a GPU this runs in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from nsa.inference import new_cache
from nsa.inference.decode import _nsa_prep, _nsa_prep_triton
from nsa.model import ModelConfig, NSAParams, Transformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = 1024.0  # every cache slot before the step (exact in bf16, far from any key or value): the ones it does
# not write must still hold it
CAPACITY = 80

# name: (query heads, key/value groups, head dim, NSA changes)
CONFIGS = {
    "sigmoid": (4, 2, 8, {}),
    "softmax": (4, 2, 8, {"gate": "softmax"}),
    "shared-kv": (4, 2, 8, {"shared_kv": True}),
    "shared-kv-softmax-linear-gate": (4, 2, 8, {"shared_kv": True, "gate": "softmax", "gate_hidden": 0}),
    "linear-gate": (4, 2, 8, {"gate_hidden": 0}),
    "m7c-like-d40": (12, 2, 40, {}),  # heads padded to 16, half a head (20) padded to 32
    "one-group": (6, 1, 8, {"gate": "softmax"}),
}
# Position 0, inside the first compressed block (l = 8), past several blocks; three sequences at different ones.
POSITIONS = {"t0": [0], "t5": [5], "t37": [37], "ragged": [70, 0, 13]}


def nsa_layer(heads, groups, head_dim, changes, dtype):
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=4, window=12, phi_hidden=16, gate_hidden=16) | changes
    cfg = ModelConfig(attention="nsa", vocab_size=53, dim=32, n_layers=1, n_heads=heads, n_kv_heads=groups,
                      head_dim=head_dim, mlp_hidden=48, nsa=NSAParams(**hp, backend="reference"))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return model.to(device=DEVICE, dtype=dtype)


def twin_caches(model, batch):
    caches = [new_cache(model, batch, CAPACITY).layers[0] for _ in range(2)]
    for layer in caches:
        layer.k.fill_(SENTINEL)
        layer.v.fill_(SENTINEL)
    return caches


def step_inputs(model, positions, dtype, seed=1):
    """(layer, x [B,1,dim], cos, sin, positions [B]): a random layer input at these positions."""
    t = torch.tensor(positions, device=DEVICE)
    x = torch.randn(len(positions), 1, model.cfg.dim, generator=torch.Generator().manual_seed(seed))
    return (model.layers[0].attn, x.to(device=DEVICE, dtype=dtype), *model.rope(t[:, None]), t)


def prep_both(model, positions, dtype):
    """(q, gates) and the layer cache of the PyTorch step and of the kernel, from one random layer input."""
    attn, x, cos, sin, t = step_inputs(model, positions, dtype)
    want_cache, got_cache = twin_caches(model, len(positions))
    with torch.no_grad():
        want = _nsa_prep(attn, x, cos, sin, want_cache, t)
        got = _nsa_prep_triton(attn, x, cos, sin, got_cache, t)
    return want, got, want_cache, got_cache, t


def written(cache, t):
    """[S,B,L] mask of the slots a step at positions t writes."""
    slots = torch.zeros(cache.k.shape[:3], dtype=torch.bool, device=DEVICE)
    slots[:, torch.arange(len(t), device=DEVICE), t] = True
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("positions", POSITIONS.values(), ids=POSITIONS.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_decode_prep_matches_the_pytorch_step(config, positions, dtype):
    heads, groups, head_dim, changes = config
    model = nsa_layer(heads, groups, head_dim, changes, dtype)
    (want_q, want_gates), (got_q, got_gates), want_cache, got_cache, t = prep_both(model, positions, dtype)
    assert got_q.shape == want_q.shape == (len(positions), heads, head_dim) and got_q.dtype == want_q.dtype
    assert got_gates.shape == want_gates.shape == (len(positions), heads, 3) and got_gates.dtype == dtype
    # float32: the same float32 arithmetic (an FMA may move the last bit); bf16: one rounding of that apart.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_gates, want_gates, **tol)
    assert torch.equal(got_cache.v, want_cache.v)  # values are copied, not computed
    torch.testing.assert_close(got_cache.k, want_cache.k, **tol)
    slots = written(got_cache, t)
    for cache in (got_cache.k, got_cache.v):
        assert (cache[~slots] == SENTINEL).all()  # no other slot touched
        assert (cache[slots] != SENTINEL).all()  # every set of every sequence written
    assert got_cache.k.shape[0] == (1 if changes.get("shared_kv") else 3)


def test_softmax_gates_share_one_and_sigmoid_gates_do_not():
    # The two gate kinds really are two paths of the kernel (the comparison above would pass for either if the
    # PyTorch step ignored the kind).
    for gate, sums_to_one in (("softmax", True), ("sigmoid", False)):
        model = nsa_layer(4, 2, 8, {"gate": gate}, torch.float32)
        _, (_, gates), *_ = prep_both(model, [9, 3], torch.float32)
        assert torch.allclose(gates.sum(-1), torch.ones(()), atol=1e-5) == sums_to_one


def test_positions_outside_the_cache_write_nothing():
    # (The PyTorch step refuses them; the host never steps past the capacity: decode.advance.)
    model = nsa_layer(4, 2, 8, {}, torch.float32)
    attn, x, cos, sin, t = step_inputs(model, [CAPACITY, -1], torch.float32)
    _, cache = twin_caches(model, 2)
    with torch.no_grad():
        q, _ = _nsa_prep_triton(attn, x, cos, sin, cache, t)
    assert torch.isfinite(q).all()
    assert (cache.k == SENTINEL).all() and (cache.v == SENTINEL).all()
