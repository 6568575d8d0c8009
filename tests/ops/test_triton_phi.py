"""phi's MLP as Triton kernels (nsa/ops/triton/compression.py) against the PyTorch module: output and every gradient.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py), so the shapes are tiny; with one,
fp32 dots use tf32, hence the looser tolerance there.
"""

import pytest
import torch

from helpers import LaunchSpy
from nsa.model.compression import BlockCompressor
from nsa.ops.triton import compression
from nsa.ops.triton.compression import phi_mlp_supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-5)

# (B, T, G, D, hidden, l, d): overlapping blocks (l = 2d) and tiling ones (l = d); odd T, T a multiple of d, T equal
# to one block; head dims and hidden widths that are not powers of two; 1 to 3 groups; more blocks than a program's.
CASES = [
    (2, 27, 2, 16, 32, 8, 4),
    (1, 53, 1, 8, 16, 8, 4),
    (2, 40, 3, 12, 20, 8, 4),
    (1, 9, 1, 16, 24, 4, 4),
    (3, 8, 2, 8, 16, 8, 4),
]


def pair(D, hidden, l, d, dtype=torch.float32):
    """The module on the PyTorch path and the same weights on the kernels, weights randomised (fc2 starts at 0)."""
    torch.manual_seed(0)
    ref = BlockCompressor(D, l, d, "mlp", hidden, backend="reference")
    for w in (ref.pos, ref.fc1.weight, ref.fc2.weight):
        torch.nn.init.normal_(w, std=0.3)
    fast = BlockCompressor(D, l, d, "mlp", hidden, backend="triton")
    fast.load_state_dict(ref.state_dict())
    return ref.to(DEVICE, dtype), fast.to(DEVICE, dtype)


def keys(B, T, G, D, dtype=torch.float32):
    """A strided slice, as the model's compressed keys are (one of three key sets)."""
    return torch.randn(B, T, 3, G, D, device=DEVICE, dtype=dtype)[:, :, 1].requires_grad_()


def grads(module, x, out, weights):
    return torch.autograd.grad((out * weights).sum(), [x, module.pos, module.fc1.weight, module.fc2.weight])


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}-G{c[2]}-l{c[5]}d{c[6]}" for c in CASES])
def test_phi_kernels_match_the_module_forward_and_every_gradient(case):
    B, T, G, D, hidden, l, d = case
    assert phi_mlp_supports(l, d)
    ref, fast = pair(D, hidden, l, d)
    x = keys(B, T, G, D)
    want, got = ref(x), fast(x)
    assert got.shape == (B, (T - l) // d + 1, G, D)
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.randn_like(want)
    for name, g, w in zip(("x", "pos", "fc1", "fc2"), grads(fast, x, got, weights), grads(ref, x, want, weights)):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{name}: {m}")


def test_phi_kernels_give_tokens_past_the_last_block_no_gradient():
    ref, fast = pair(8, 16, 8, 4)
    x = keys(1, 14, 1, 8)  # blocks cover tokens 0..11; 12 and 13 wait for the next block
    dx = torch.autograd.grad(fast(x).sum(), x)[0]
    assert dx[:, 12:].abs().max() == 0 and dx[:, :12].abs().min() > 0


@pytest.mark.parametrize("weights", ["float16", "float32"], ids=["half weights", "float32 weights (autocast)"])
def test_phi_kernels_in_half_precision(weights):
    ref, fast = pair(16, 32, 8, 4)
    fast.to(getattr(torch, weights))
    x = keys(2, 27, 2, 16)
    x16 = x.detach().half().requires_grad_()
    want = ref(x)
    got = fast(x16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    w = torch.randn_like(want)
    got_grads = grads(fast, x16, got.float(), w)
    assert [g.dtype for g in got_grads[1:]] == [getattr(torch, weights)] * 3
    for g, r in zip(got_grads, grads(ref, x, want, w)):
        torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=2e-2)


def test_other_geometries_and_short_sequences_take_the_pytorch_path(monkeypatch):
    assert not phi_mlp_supports(12, 8) and not phi_mlp_supports(12, 4)  # 12 / 4: a token in three blocks
    spy = LaunchSpy(compression._phi_fwd_kernel)
    monkeypatch.setattr(compression, "_phi_fwd_kernel", spy)
    _, fast = pair(8, 16, 12, 8)
    x = keys(1, 30, 2, 8)
    blocks = x.unfold(1, 12, 8).transpose(-1, -2)  # the module's formula, written out
    mlp = fast.fc2(torch.nn.functional.silu(fast.fc1((blocks + fast.pos).flatten(-2))))
    torch.testing.assert_close(fast(x), blocks.mean(-2) + mlp)
    assert fast(x[:, :11]).shape == (1, 0, 2, 8)
    _, tiling = pair(8, 16, 4, 4)
    assert tiling(x[:, :3]).shape == (1, 0, 2, 8)
    assert spy.launches == []  # no kernel for either



def test_fc1_splits_add_atomically_unless_deterministic_mode_sums_them_in_order(monkeypatch):
    spy = LaunchSpy(compression._phi_bwd_w1_kernel)
    monkeypatch.setattr(compression, "_phi_bwd_w1_kernel", spy)
    ref, fast = pair(16, 32, 8, 4)
    x = keys(2, 40, 2, 16)
    weights = torch.randn_like(ref(x))
    want = grads(ref, x, ref(x), weights)
    atomic = grads(fast, x, fast(x), weights)
    torch.use_deterministic_algorithms(True)
    try:
        first = grads(fast, x, fast(x), weights)
        second = grads(fast, x, fast(x), weights)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [kwargs["ATOMIC"] for _, kwargs in spy.launches] == [True, False, False]
    for a, b, w in zip(first, second, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, w, **TOL)
    torch.testing.assert_close(atomic[2], want[2], **TOL)


def test_keys_and_values_in_one_launch_match_each_alone():
    from nsa.model.compression import compress_pair

    _, first = pair(16, 32, 8, 4)
    torch.manual_seed(1)
    _, second = pair(16, 32, 8, 4)
    for w in second.mlp_weights:  # different weights from the first's
        torch.nn.init.normal_(w, std=0.3)
    x, y = keys(2, 27, 2, 16), keys(2, 27, 2, 16)
    spy = LaunchSpy(compression._phi_fwd_kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compression, "_phi_fwd_kernel", spy)
        both = compress_pair(first, second, x, y)
    assert [grid[2] for grid, _ in spy.launches] == [2]  # one launch, two sets
    alone = first(x), second(y)
    weights = [torch.randn_like(o) for o in alone]
    params = [x, y, *first.mlp_weights, *second.mlp_weights]
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(both, weights)), params)
    want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(alone, weights)), params)
    for o, a in zip(both, alone):
        torch.testing.assert_close(o, a, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    short = compress_pair(first, second, x[:, :7], y[:, :7])  # shorter than a block: no kernel
    assert all(o.shape == (2, 0, 2, 16) for o in short)
