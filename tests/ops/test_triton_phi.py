"""phi's MLP as Triton kernels (nsa/ops/triton/compression.py) against the PyTorch module: output and every gradient.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py), so the shapes are tiny; with one,
a looser tolerance: float32 products are TF32 wherever PyTorch allows it (the trainer does, on a GPU).
"""

import pytest
import torch

from helpers import DispatchedOps, LaunchSpy
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


# Packed documents: (lengths, G, D, hidden, l, d). Documents of one token, shorter than a block, exactly one block,
# not multiples of d, empty ones between documents and trailing (padding), one with no compressed token last.
PACKED_CASES = [
    ([1, 5, 0, 13, 8, 22, 3, 0, 0], 2, 16, 32, 8, 4),
    ([11, 1, 17, 0, 9], 1, 8, 16, 8, 4),
    ([6, 4, 9, 0, 13], 3, 12, 20, 4, 4),
    ([3, 2, 7], 1, 8, 16, 8, 4),  # no document holds a block
]


def boundaries(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def check_packed(ref, fast, x, cu, x_ref=None, tol=TOL, blocks=True):
    """The kernels (fast) on packed x against the module's PyTorch packed path (ref, on x_ref): every row, and every
    gradient; gradients that are not zero where some document holds a block, zero where none does."""
    x_ref = x if x_ref is None else x_ref
    want, got = ref(x_ref, cu), fast(x, cu)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want, **tol)
    weights = torch.randn_like(want)
    pairs = zip(("x", "pos", "fc1", "fc2"), grads(fast, x, got.float(), weights), grads(ref, x_ref, want, weights))
    for name, g, w in pairs:
        assert (w.abs().max() > 0) == blocks, name
        torch.testing.assert_close(g.float(), w, **tol, msg=lambda m: f"{name}: {m}")
    return got


@pytest.mark.parametrize("case", PACKED_CASES, ids=[f"docs{len(c[0])}-G{c[1]}-l{c[4]}d{c[5]}" for c in PACKED_CASES])
def test_packed_phi_kernels_match_the_packed_module_forward_and_every_gradient(case, monkeypatch):
    lengths, G, D, hidden, l, d = case
    spies = {name: LaunchSpy(getattr(compression, name)) for name in
             ("_phi_fwd_kernel", "_phi_bwd_rows_kernel", "_phi_bwd_tokens_kernel", "_phi_bwd_w1_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(compression, name, spy)
    ref, fast = pair(D, hidden, l, d)
    x = keys(1, sum(lengths), G, D)
    rows = sum((n - l) // d + 1 for n in lengths if n >= l)
    got = check_packed(ref, fast, x, boundaries(lengths), blocks=rows > 0)
    assert rows < got.shape[1] and got[:, rows:].abs().max() == 0 and (rows == 0 or got[:, :rows].abs().min() > 0)
    cut = boundaries(lengths).tolist()  # each document alone on the unpacked module: its rows, in order
    alone = [ref(x[:, s:e]) for s, e in zip(cut[:-1], cut[1:]) if e - s >= l]
    if alone:
        torch.testing.assert_close(got[:, :rows], torch.cat(alone, 1).detach(), **TOL)
    assert all(kwargs["PACKED"] for spy in spies.values() for _, kwargs in spy.launches)
    assert all(len(spy.launches) == 1 for spy in spies.values())


def test_packed_phi_kernels_give_tokens_outside_every_block_no_gradient():
    ref, fast = pair(8, 16, 8, 4)
    lengths = [14, 5, 12]  # blocks cover tokens 0..11 of the first document, none of the second, all of the third
    x = keys(1, sum(lengths), 1, 8)
    dx = torch.autograd.grad(fast(x, boundaries(lengths)).sum(), x)[0][0]
    assert dx[12:19].abs().max() == 0
    assert dx[:12].abs().min() > 0 and dx[19:].abs().min() > 0


def test_one_packed_document_is_the_unpacked_kernels_bit_for_bit():
    _, fast = pair(16, 32, 8, 4)
    x = keys(1, 27, 2, 16)
    packed, plain = fast(x, boundaries([27])), fast(x)
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)
    weights = torch.randn_like(plain)
    for a, b in zip(grads(fast, x, packed, weights), grads(fast, x, plain, weights)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("weights", ["float16", "float32"], ids=["half weights", "float32 weights (autocast)"])
def test_packed_phi_kernels_in_half_precision(weights):
    ref, fast = pair(16, 32, 8, 4)
    fast.to(getattr(torch, weights))
    lengths = [9, 1, 0, 14, 6, 0]
    x = keys(1, sum(lengths), 2, 16)
    x16 = x.detach().half().requires_grad_()
    check_packed(ref, fast, x16, boundaries(lengths), x_ref=x, tol=dict(rtol=2e-2, atol=2e-2))


def test_packed_keys_and_values_in_one_launch_match_each_alone_and_deterministic_mode():
    from nsa.model.compression import compress_pair

    _, first = pair(16, 32, 8, 4)
    torch.manual_seed(1)
    _, second = pair(16, 32, 8, 4)
    for w in second.mlp_weights:
        torch.nn.init.normal_(w, std=0.3)
    lengths = [10, 0, 3, 17, 0]
    cu = boundaries(lengths)
    x, y = keys(1, 30, 2, 16), keys(1, 30, 2, 16)
    params = [x, y, *first.mlp_weights, *second.mlp_weights]
    spy = LaunchSpy(compression._phi_bwd_tokens_kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compression, "_phi_bwd_tokens_kernel", spy)
        both = compress_pair(first, second, x, y, cu)
        weights = [torch.randn_like(o) for o in both]
        got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(both, weights)), params)
    assert [grid[2] for grid, _ in spy.launches] == [2]  # one launch, two sets
    alone = first(x, cu), second(y, cu)
    want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(alone, weights)), params)
    for o, a in zip(both, alone):
        torch.testing.assert_close(o, a, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(compress_pair(first, second, x, y, cu),
                                                                          weights)), params) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b, w in zip(*runs, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, w, **TOL)


def test_compression_layout_cuts_chunks_of_d_tokens_inside_each_document():
    from nsa.ops.packing import compression_layout

    cu = torch.tensor([0, 1, 10, 10, 17], dtype=torch.int32)  # lengths 1, 9, 0, 7
    layout = compression_layout(cu, 4, 2, 17)
    # Blocks of 4 tokens, 2 apart: document 1 (tokens 1..9) has 3 at 1, 3, 5; document 3 (10..16) 2 at 10, 12.
    assert layout.row_start.tolist() == [1, 3, 5, 10, 12, 17, 17]
    # Chunks of 2 from each document's first token: 1 + 5 + 0 + 4 of them; capacity ceil(17 / 2) + 4.
    assert layout.chunk_start.tolist() == [0, 1, 3, 5, 7, 9, 10, 12, 14, 16] + [17] * 3
    assert layout.cmp_start.tolist() == [0] * 10 + [3] * 7
    assert layout.doc_start.tolist() == [0] + [1] * 9 + [10] * 7
    assert layout.doc_end.tolist() == [1] + [10] * 9 + [17] * 7


def test_eager_calls_skip_the_custom_ops_and_match_them_bit_for_bit(monkeypatch):
    # An eager call runs nsa::phi_mlp's kernels as an autograd.Function (no dispatcher host time); through the
    # custom ops (as torch.compile calls them) the output and every gradient are the same bits.
    B, T, G, D, hidden, l, d = CASES[0]
    _, fast = pair(D, hidden, l, d)
    x = keys(B, T, G, D)
    ops = {"nsa::phi_mlp", "nsa::phi_mlp_backward"}
    runs = []
    for eager in (True, False):
        monkeypatch.setattr(compression, "eager_call", lambda tensors, eager=eager: eager)
        with DispatchedOps() as seen:
            out = fast(x)
            runs.append((out, grads(fast, x, out, torch.ones_like(out))))
        assert (ops & seen.names) == (set() if eager else ops)
    (out, g), (op_out, op_g) = runs
    assert torch.equal(out, op_out)
    for name, a, b in zip(("x", "pos", "fc1", "fc2"), g, op_g):
        assert torch.equal(a, b), name
