"""Triton kernels against the reference: outputs, selected blocks and every gradient.

Without a GPU these run in Triton's CPU interpreter (tests/conftest.py), whose cost
grows with the number of programs, so the shapes are tiny. With a GPU the same tests
run the compiled kernels, at a looser tolerance: their float32 products are TF32 wherever PyTorch allows it (the
trainer does, on a GPU).
"""

import pytest
import torch

from helpers import NAMES, DispatchedOps, LaunchSpy, assert_same_selection, nsa_inputs
from nsa.ops import NSAGeometry, nsa_attention, reference, select_blocks, tuning
from nsa.ops.branches import BLOCKS, MODE_CMP, TILED, TOKEN
from nsa.ops.dispatch import selected_path, span_forward
from nsa.ops.triton.inverse_index import inverse_index, sort_key_dtype
from nsa.ops.triton.selection import select_blocks_fwd
from nsa.ops.triton.span_attention import chosen_bits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-5)


def inputs(*shape, dtype=torch.float32, requires_grad=False, **kw):
    ins = nsa_inputs(*shape, dtype=dtype, **kw)
    return [t.to(DEVICE).requires_grad_(requires_grad) for t in ins]


# (B, T, H, G, Dk, Dv, l, d, l', n, w): group sizes 1, 3, 6 and 16; odd T; T shorter than a block; Dk != Dv;
# T long enough for key steps that every row of a tile sees whole (the kernels skip masking those).
CASES = [
    (1, 203, 2, 2, 8, 8, 8, 4, 16, 4, 40),
    (1, 29, 2, 2, 8, 8, 8, 4, 8, 3, 7),
    (2, 37, 6, 2, 8, 6, 8, 4, 8, 4, 9),
    (1, 41, 6, 1, 16, 8, 8, 4, 16, 3, 9),
    (1, 23, 16, 1, 4, 4, 8, 4, 8, 3, 5),
    (2, 7, 2, 1, 4, 4, 8, 4, 8, 3, 3),
]


@pytest.fixture(params=["tiled", "gathered", "tiled forward"])
def sel_path(request, monkeypatch):
    """Run the selected branch tiled (short-T path), gathered (per-token or block-centric, by group size), or tiled
    in the forward and gathered in the backward (the default between 32 and 64 blocks for small groups)."""
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups"):
        monkeypatch.setattr(tuning.TUNING, field, 10**9 if request.param == "tiled" else 0)
    monkeypatch.setattr(tuning.TUNING, "tiled_max_blocks_forward", 0 if request.param == "gathered" else 10**9)
    return request.param


def test_selected_path_is_tiled_while_blocks_are_few_then_by_group_size():
    few = min(tuning.TUNING.tiled_max_blocks, 64)
    assert selected_path(few * 64, 6, 64) == TILED
    assert selected_path(few * 64 + 1, 6, 64) == BLOCKS
    few = min(tuning.TUNING.tiled_max_blocks_large_groups, 64)
    assert selected_path(few * 64, 16, 64) == TILED
    assert selected_path(few * 64 + 1, 16, 64) == TOKEN
    # The forward stays tiled up to its own limit; the backward's path is unchanged.
    few = min(max(tuning.TUNING.tiled_max_blocks, tuning.TUNING.tiled_max_blocks_forward), 64)
    assert selected_path(few * 64, 6, 64, forward=True) == TILED
    assert selected_path(few * 64 + 1, 6, 64, forward=True) == BLOCKS


def test_chosen_bits_mark_exactly_the_chosen_blocks():
    idx = torch.tensor([[[[0, 5, -1], [63, 2, 1]]]])  # [B=1, T=1, G=2, n=3]
    bits = chosen_bits(idx, 64)
    as_int64 = (1 << 63 | 1 << 2 | 1 << 1) - (1 << 64)  # bit 63 is the sign bit; the kernels shift and mask
    assert bits.tolist() == [[[1 | 1 << 5, as_int64]]]
    with pytest.raises(ValueError, match="at most 64"):
        chosen_bits(idx, 65)
    # Many rows (not a multiple of the kernel's row block), distinct blocks per row, unused slots -1.
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(64, generator=g)[:5] for _ in range(2 * 19 * 3)]).view(2, 19, 3, 5)
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    want = [[[sum(1 << b for b in row if b >= 0) for row in grp] for grp in seq] for seq in idx.tolist()]
    want = torch.tensor([[[w - (1 << 64) if w >= 1 << 63 else w for w in grp] for grp in seq] for seq in want])
    assert torch.equal(chosen_bits(idx, 64), want)


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}-h{c[2] // c[3]}" for c in CASES])
def test_triton_nsa_matches_reference_forward_and_every_gradient(case, sel_path):
    B, T, H, G, Dk, Dv, l, d, lp, n, w = case
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    ins = inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, seed=T, requires_grad=True)
    out = nsa_attention(*ins, **hp, backend="triton")
    ref = nsa_attention(*ins, **hp, backend="reference")
    torch.testing.assert_close(out, ref, **TOL)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, do)
    ref_grads = torch.autograd.grad(ref, ins, do)
    for name, g, r in zip(NAMES, grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"d{name}: {m}")


def test_a_forward_without_gradients_skips_the_inverse_index_a_block_centric_backward_needs(monkeypatch):
    # Between the two tiled limits the forward is tiled and the backward block-centric: the forward builds the
    # backward's inverse index only when a backward can follow.
    from nsa.ops import custom_ops

    monkeypatch.setattr(tuning.TUNING, "tiled_max_blocks", 0)
    monkeypatch.setattr(tuning.TUNING, "tiled_max_blocks_forward", 10**9)
    built = []
    original = custom_ops.build_inverse_index
    monkeypatch.setattr(custom_ops, "build_inverse_index", lambda *a: built.append(1) or original(*a))
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)
    ins = inputs(1, 37, 6, 2, 8, 8, block_len=8, block_stride=4, seed=5)
    ref = nsa_attention(*ins, **hp, backend="reference")
    with torch.no_grad():
        out = nsa_attention(*[t.requires_grad_() for t in ins], **hp, backend="triton")
    assert not built
    torch.testing.assert_close(out, ref, **TOL)
    out = nsa_attention(*ins, **hp, backend="triton")
    assert built
    torch.testing.assert_close(out, ref, **TOL)
    do = torch.randn_like(out)
    ref = nsa_attention(*ins, **hp, backend="reference")
    for name, g, r in zip(NAMES, torch.autograd.grad(out, ins, do), torch.autograd.grad(ref, ins, do)):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"d{name}: {m}")


def test_only_the_output_takes_a_gradient_and_no_zero_gradient_is_filled_for_the_rest():
    # nsa::forward also returns what its backward reads (branch outputs, lse, indices, the inverse index); autograd
    # must neither treat them as differentiable nor fill a zero gradient for each before the backward.
    from torch.utils._python_dispatch import TorchDispatchMode

    from nsa.ops import custom_ops

    geometry = NSAGeometry(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)
    ins = inputs(1, 37, 6, 2, 8, 8, block_len=8, block_stride=4, seed=5, requires_grad=True)
    outs = custom_ops.nsa_forward(*ins, *geometry.as_tuple(), 8**-0.5, True)
    assert [t.requires_grad for t in outs] == [True] + [False] * 11

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.shapes.append((tuple(out.shape), out.dtype))
            return out

    with Created() as created:
        outs[0].backward(torch.randn_like(outs[0]))
    indices = outs[7]
    assert (tuple(indices.shape), indices.dtype) not in created.shapes, "a zero gradient was made for the indices"
    assert all(t.grad is not None for t in ins)


def test_eager_calls_skip_the_custom_ops_and_match_them_bit_for_bit(sel_path):
    # An eager call runs the custom ops' stages as an autograd.Function (no dispatcher host time): no nsa::forward
    # or nsa::backward is dispatched, and the output and every gradient equal the custom ops' bit for bit.
    from nsa.ops import custom_ops

    B, T, H, G, Dk, Dv, l, d, lp, n, w = SMALL
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    ins = inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, seed=3, requires_grad=True)
    do = torch.randn(B, T, H, Dv)
    with DispatchedOps() as seen:
        out = nsa_attention(*ins, **hp, backend="triton")
        grads = torch.autograd.grad(out, ins, do)
    assert not {"nsa::forward", "nsa::backward"} & seen.names
    geometry = NSAGeometry(**hp)
    with DispatchedOps() as seen:
        op_out = custom_ops.nsa_forward(*ins, *geometry.as_tuple(), Dk**-0.5, True)[0]
        op_grads = torch.autograd.grad(op_out, ins, do)
    assert {"nsa::forward", "nsa::backward"} <= seen.names
    assert torch.equal(out, op_out)
    for name, g, r in zip(NAMES, grads, op_grads):
        assert torch.equal(g, r), name


def test_a_compiled_call_takes_the_custom_op():
    # torch.compile traces the call into one nsa::forward node (opaque to the compiler), not into its stages.
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    B, T, H, G, Dk, Dv, l, d, lp, n, w = SMALL
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    ins = inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, seed=3)
    compiled = torch.compile(lambda *x: nsa_attention(*x, **hp, backend="triton"), backend=record, fullgraph=True)
    torch.testing.assert_close(compiled(*ins), nsa_attention(*ins, **hp, backend="triton"), rtol=0, atol=0)
    assert "nsa.forward.default" in targets




@pytest.fixture
def small_splits(monkeypatch):
    """Split dK/dV rows and several work items a block at these tiny shapes on a GPU too (the CPU defaults)."""
    for field, value in (("cmp_rows_per_split", 32), ("dkdv_block_m", 16), ("inverse_chunk", 4)):
        monkeypatch.setattr(tuning.TUNING, field, value)


@pytest.fixture
def spies(monkeypatch):
    """The split dK/dV kernel's and the selected backward's launches, by kernel name."""
    from nsa.ops.triton import selected_attention, span_attention

    found = {}
    for module, name in ((span_attention, "_span_dkdv_kernel"), (selected_attention, "_sel_bwd_kernel")):
        found[name] = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, found[name])
    return found


@pytest.fixture
def deterministic_mode():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


# The block-centric selected branch (h = 3; block 0's 29 queries make 8 work items of 4) and the tiled one (h = 16:
# MODE_SEL's split rows); 87 and 368 (token, head) rows make 3 and 12 compressed-branch splits of 32.
SMALL = (1, 29, 6, 2, 8, 8, 8, 4, 8, 3, 7)
DETERMINISTIC_CASES = [("gathered", SMALL), ("tiled", CASES[4])]


@pytest.mark.parametrize("sel_path,case", DETERMINISTIC_CASES, ids=["gathered-h3", "tiled-h16"])
def test_deterministic_mode_adds_no_atomics_matches_the_reference_and_repeats_bit_for_bit(sel_path, case,
                                                                                        deterministic_mode,
                                                                                        small_splits, spies,
                                                                                        monkeypatch):
    # Deterministic mode: the dK/dV kernels' row splits and the selected branch's work items write partial sums
    # that are added in a fixed order, where otherwise float32 atomics add them in whatever order they land.
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
        monkeypatch.setattr(tuning.TUNING, field, 10**9 if sel_path == "tiled" else 0)
    B, T, H, G, Dk, Dv, l, d, lp, n, w = case
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    ins = inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, seed=T, requires_grad=True)
    ref = nsa_attention(*ins, **hp, backend="reference")
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ins, do)
    runs = [torch.autograd.grad(nsa_attention(*ins, **hp, backend="triton"), ins, do) for _ in range(2)]
    for name, g, again, r in zip(NAMES, *runs, ref_grads):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"d{name}: {m}")
        assert torch.equal(g, again), f"d{name} differs between two deterministic runs"
    split_launches = [kw for grid, kw in spies["_span_dkdv_kernel"].launches if grid[1] > 1]
    assert split_launches and not any(kw["ATOMIC"] for kw in split_launches)
    item_launches = spies["_sel_bwd_kernel"].launches
    assert all(kw["PARTIALS"] for _, kw in item_launches)
    assert item_launches or sel_path == "tiled"


def test_skip_deterministic_fill_lifts_the_nan_fill_of_deterministic_mode_and_restores_it():
    from nsa.ops.triton.common import skip_deterministic_fill

    with pytest.raises(ValueError):
        with skip_deterministic_fill():
            assert torch.utils.deterministic.fill_uninitialized_memory is False
            raise ValueError
    assert torch.utils.deterministic.fill_uninitialized_memory is True


def test_without_deterministic_mode_split_rows_and_items_add_atomically(small_splits, spies, monkeypatch):
    monkeypatch.setattr(tuning.TUNING, "tiled_max_blocks", 0)
    B, T, H, G, Dk, Dv, l, d, lp, n, w = SMALL
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    ins = inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, seed=T, requires_grad=True)
    out = nsa_attention(*ins, **hp, backend="triton")
    torch.autograd.grad(out, ins, torch.randn_like(out))
    assert any(kw["ATOMIC"] for grid, kw in spies["_span_dkdv_kernel"].launches if grid[1] > 1)
    assert spies["_sel_bwd_kernel"].launches and not any(kw["PARTIALS"] for _, kw in spies["_sel_bwd_kernel"].launches)


def test_triton_nsa_in_half_precision(sel_path):
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)
    ins = inputs(1, 33, 4, 2, 16, 16, block_len=8, block_stride=4, seed=1, dtype=torch.float16, requires_grad=True)
    out = nsa_attention(*ins, **hp, backend="triton")
    assert out.dtype == torch.float16
    f32 = [t.detach().float().requires_grad_() for t in ins]
    ref = nsa_attention(*f32, **hp, backend="reference")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    do = torch.randn_like(ref)
    for name, g, r in zip(NAMES, torch.autograd.grad(out, ins, do.half()), torch.autograd.grad(ref, f32, do)):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g.float(), r, rtol=3e-2, atol=3e-2, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize(
    "T,H,G,l,d,lp,n",
    [
        (100, 2, 1, 8, 4, 4, 5),  # 25 selection blocks: two chunks of 16, with carry-over (l > d)
        (90, 3, 3, 6, 3, 9, 4),  # l'/d = 3: a chunk is not a power of two compressed tokens
        (200, 3, 3, 6, 3, 9, 4),  # ... and later tiles see a whole chunk (no visibility mask, zero-weight columns)
        (70, 4, 2, 4, 2, 2, 20),  # n > 16: running list of 32
        (40, 6, 1, 16, 4, 4, 3),  # l = 4 l': a compressed token spans four selection blocks
        # l = 4 l' with free slots: compressed tokens not yet visible reach unforced blocks, so the
        # visibility mask decides the ranking (with l <= l' they only touch the forced blocks)
        (150, 4, 2, 16, 4, 4, 8),
        # l <= l' with l'/d a power of two (M7C's 32/16/64 scaled down): the per-rank weights and the shift
        # into the next block, across chunks; then l = l', where a token's second half spills over
        (300, 6, 1, 8, 4, 16, 5),
        (200, 4, 2, 8, 4, 8, 4),
        # Groups that are not a power of two: transposed, heads in two sets (3 = 2 + 1, 5 = 4 + 1, 7 = 4 + 3 padded)
        (150, 3, 1, 8, 4, 16, 5),
        (150, 10, 2, 8, 4, 16, 5),
        (120, 7, 1, 8, 4, 8, 4),
    ],
)
@pytest.mark.parametrize("transposed", [True, False])
def test_selection_kernel_matches_reference(T, H, G, l, d, lp, n, transposed, monkeypatch):
    # Both layouts of the scores (transposed up to select_transposed_max_rows rows, with Eq. 9 as overlap products;
    # untransposed beyond, with the two-weight stencil where the geometry allows it).
    monkeypatch.setattr(tuning.TUNING, "select_transposed_max_rows", 10**9 if transposed else 0)
    q, k_cmp, *_ = inputs(1, T, H, G, 8, 8, block_len=l, block_stride=d, seed=T)
    idx = select_blocks(q, k_cmp, block_len=l, block_stride=d, sel_block=lp, n_sel=n, backend="triton")
    ref = reference.select_blocks(q, k_cmp, block_len=l, block_stride=d, sel_block=lp, n_sel=n)
    scores = reference.selection_scores(q, k_cmp, block_len=l, block_stride=d, sel_block=lp)
    assert idx.shape == ref.shape and idx.dtype == torch.int64
    assert_same_selection(idx, ref, scores, rtol=1e-5 if DEVICE == "cpu" else 1e-2)


def test_selection_ties_go_to_the_lower_block():
    # q = 0: every visible compressed token gets the same probability, so many block scores tie exactly.
    q, k_cmp, *_ = inputs(1, 80, 2, 1, 8, 8, block_len=4, block_stride=4, seed=0)
    q = torch.zeros_like(q)
    idx = select_blocks(q, k_cmp, block_len=4, block_stride=4, sel_block=4, n_sel=5, backend="triton")
    assert torch.equal(idx, reference.select_blocks(q, k_cmp, block_len=4, block_stride=4, sel_block=4, n_sel=5))


@pytest.mark.parametrize("B,T,G,n,Ns,key_dtype", [(2, 30, 2, 3, 8, torch.uint8), (1, 30, 2, 3, 300, torch.int16),
                                                 (1, 20, 1, 3, 40000, torch.int32)])
@pytest.mark.parametrize("query_range", [None, 7])
def test_inverse_index_lists_every_query_of_every_block_in_chunks(B, T, G, n, Ns, key_dtype, query_range):
    # The sort's keys take the narrowest type that holds B * G * Ns + 1 values (one byte, two, four).
    assert sort_key_dtype(B * G * Ns) == key_dtype
    torch.manual_seed(0)
    idx = torch.randint(-1, Ns, (B, T, G, n))
    key, start, count, entries = (x.cpu() for x in inverse_index(idx.to(DEVICE), Ns, chunk=3,
                                                                 query_range=query_range))
    qr = query_range or T
    assert count.max() <= 3
    # Unused items (count 0) follow the used ones, with key B * G * Ns.
    used = count > 0
    assert torch.all(key[~used] == B * G * Ns) and not used[used.sum():].any()
    # Items are ordered by (b, g, query range, block), each within one range; unsplit, item_key ascends over the
    # whole array (the deterministic backward finds a key's items by binary search).
    t_first = entries[start[used].long()] // n % T
    group = (key[used] // Ns * T + t_first // qr) * Ns + key[used] % Ns
    assert torch.all(group[1:] >= group[:-1])
    if query_range is None:
        assert torch.all(key[1:] >= key[:-1])
    # Every item is full but the last of its block and range.
    last = torch.ones_like(group, dtype=torch.bool)
    last[:-1] = group[1:] != group[:-1]
    assert torch.all(count[used][~last] == 3)
    got = {}
    for k, s, c in zip(key.tolist(), start.tolist(), count.tolist()):
        ts = [f // n % T for f in entries[s : s + c].tolist()]
        assert len({t // qr for t in ts}) <= 1
        for f in entries[s : s + c].tolist():
            b, g, t, slot = f // (G * T * n), f // (T * n) % G, f // n % T, f % n
            assert idx[b, t, g, slot] == k % Ns and (b * G + g) == k // Ns
            got.setdefault(k, []).append(t)
    want = {}
    for b in range(B):
        for g in range(G):
            for t in range(T):
                for j in idx[b, t, g].tolist():
                    if j >= 0:
                        want.setdefault((b * G + g) * Ns + j, []).append(t)
    assert got == want
    per_range = {}
    for k, ts in want.items():
        for t in ts:
            per_range[(k, t // qr)] = per_range.get((k, t // qr), 0) + 1
    assert used.sum() == sum(-(-c // 3) for c in per_range.values())


def test_block_centric_selected_dq_partials_sum_to_the_reference_gradient(monkeypatch):
    # SelectedDQ.dense sums the per-(query, slot, head) partials over the used slots: it must give dQ of the
    # selected branch (the GPU tests compare the Gluon kernel's float32 dQ with it).
    from nsa.ops import dispatch
    from nsa.ops.triton.inverse_index import build_inverse_index

    for field in ("tiled_max_blocks", "tiled_max_blocks_forward"):
        monkeypatch.setattr(tuning.TUNING, field, 0)
    torch.manual_seed(0)
    B, T, H, G, D, sb = 2, 70, 4, 2, 16, 16
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, G, D), torch.randn(B, T, G, D)
    k_cmp = torch.randn(B, (T - 8) // 4 + 1, G, D)
    idx = select_blocks(q, k_cmp, block_len=8, block_stride=4, sel_block=sb, n_sel=3, backend="triton")
    assert (idx < 0).any(), "no unused slot: the sum's mask would go unchecked"
    q, k, v, idx = (x.to(DEVICE) for x in (q, k, v, idx))
    inverse = build_inverse_index(idx, T, sb)
    geometry = NSAGeometry(block_len=8, block_stride=4, sel_block=sb, n_sel=3, window=1)
    o_other, gates = torch.zeros_like(q), torch.ones(B, T, H, 3, device=DEVICE)
    _, o_sel, lse = dispatch.selected_forward(q, k, v, idx, inverse, o_other, o_other, gates, D**-0.5, geometry)
    do = torch.randn_like(o_sel)
    _, _, sel = dispatch.selected_backward(q, k, v, idx, inverse, do, lse, (do * o_sel).sum(-1), D**-0.5, geometry)
    assert sel.parts is not None
    qr = q.detach().cpu().requires_grad_()
    ref = reference.selected_attention(qr, k.cpu(), v.cpu(), idx.cpu(), sel_block=sb)
    (want,) = torch.autograd.grad(ref, qr, do.cpu())
    torch.testing.assert_close(sel.dense().cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_each_branch_alone_matches_the_reference(branch, sel_path):
    # One gate at 1, the others at 0: the output and every gradient come from that branch alone.
    # Block 0 is chosen by all 40 queries, so its selected-branch work is split into several items
    # (4 queries each under the interpreter) that add their dK/dV atomically.
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)
    ins = inputs(1, 40, 4, 2, 8, 8, block_len=8, block_stride=4, seed=3)
    gates = torch.zeros_like(ins[7])
    gates[..., ("cmp", "sel", "win").index(branch)] = 1.0
    ins = [t.requires_grad_() for t in ins[:7] + [gates]]
    out = nsa_attention(*ins, **hp, backend="triton")
    ref = nsa_attention(*ins, **hp, backend="reference")
    torch.testing.assert_close(out, ref, **TOL)
    do = torch.randn_like(out)
    for name, g, r in zip(NAMES, torch.autograd.grad(out, ins, do), torch.autograd.grad(ref, ins, do)):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"d{name}: {m}")


def test_compressed_kernel_reports_minus_infinity_lse_where_nothing_is_visible():
    q, k_cmp, v_cmp, *_ = inputs(1, 20, 2, 1, 8, 8, block_len=8, block_stride=4, seed=2)
    geometry = NSAGeometry(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=1)
    o, lse = span_forward(q, k_cmp, v_cmp, MODE_CMP, 0.3, geometry)
    assert torch.isinf(lse[:, :7]).all() and (o[:, :7] == 0).all()
    assert torch.isfinite(lse[:, 7:]).all()
    idx = select_blocks_fwd(q, k_cmp, lse, 0.3, geometry)
    assert idx[0, 0, 0].tolist() == [0, -1, -1]


def test_auto_backend_is_triton_on_cuda_and_the_reference_elsewhere():
    from nsa.ops.api import resolve_backend as _resolve

    assert _resolve("auto", torch.device("cuda"), 10) == "triton"
    assert _resolve("auto", torch.device("cpu"), 10) == "reference"  # the interpreter only when asked for
    assert _resolve("reference", torch.device("cuda"), 10) == "reference"
    assert _resolve("triton", torch.device("cuda"), 0) == "reference"  # empty sequences need no kernel
    with pytest.raises(ValueError, match="unknown NSA backend"):
        _resolve("flash", torch.device("cpu"), 10)


GLUON_KERNELS = [("forward", "_span_forward_kernel"), ("backward", "_span_dkdv_kernel"),
                 ("query_grad", "_query_grad_kernel"), ("selected_forward", "_selected_forward_kernel"),
                 ("selected_backward", "_selected_backward_kernel")]


@pytest.fixture
def gluon_binds(monkeypatch):
    """The Gluon kernels (which run only on an sm_90 GPU) replaced by stand-ins that bind each launch's arguments to
    the kernel's parameters (a missing, extra or doubled one fails) and record the kernel's name."""
    import importlib
    import inspect

    launched = []

    class Bind:
        def __init__(self, kernel):
            self.signature = inspect.signature(kernel.fn)
            self.name = kernel.fn.__name__

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = self.signature.bind(*args, **kwargs)
                missing = [n for n, p in self.signature.parameters.items()
                           if n not in bound.arguments and p.default is p.empty]
                assert not missing, (self.name, missing)
                launched.append(self.name)
            return launch

    for module, name in GLUON_KERNELS:
        module = importlib.import_module(f"nsa.ops.gluon.{module}")
        monkeypatch.setattr(module, name, Bind(getattr(module, name)))
    return launched


def test_every_gluon_launch_passes_each_argument_its_kernel_takes(gluon_binds):
    from nsa.ops.branches import SEL_DENSE, SEL_PARTS, SEL_TILED, SelectedDQ
    from nsa.ops.gluon import backward, forward, query_grad, selected_backward, selected_forward

    geometry = NSAGeometry(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)
    B, T, H, G, D, n = 2, 300, 12, 2, 64, 16
    q, o = torch.randn(B, T, H, D, dtype=torch.bfloat16), torch.empty(B, T, H, D, dtype=torch.bfloat16)
    k, v = torch.randn(B, T, G, D, dtype=torch.bfloat16), torch.randn(B, T, G, D, dtype=torch.bfloat16)
    lse, gates = torch.empty(B, T, H), torch.rand(B, T, H, 3, dtype=torch.bfloat16)
    bits, idx = torch.zeros(B, T, G, dtype=torch.int64), torch.zeros(B, T, G, n, dtype=torch.int64)
    for mode, chosen, strides, gated in ((0, q, (0, 0, 0), None), (2, bits, bits.stride(), (o, o, gates))):
        forward.launch(q, k, v, o, lse, mode, 0.1, geometry, chosen, strides, gated, o)
        for parts in (1, 3):
            grads = torch.zeros(parts, *k.shape)
            backward.launch(q, k, v, o, lse, lse, grads, grads, mode, 0.1, geometry, chosen, strides, 3, 256)
    parts = torch.empty(B * G * T * n, H // G, D, dtype=torch.bfloat16)
    for sel in (SelectedDQ(SEL_TILED, k=k, v=v, choice=bits), SelectedDQ(SEL_PARTS, choice=idx, parts=parts),
                SelectedDQ(SEL_DENSE, choice=idx, dq=torch.empty(B, T, H, D))):
        query_grad.launch(q, o, o, torch.empty(3, B, T, H), torch.empty(3, B, T, H), 0.1, geometry, (k, v), (k, v),
                          sel)
    inverse = tuple(torch.zeros(10, dtype=torch.int32) for _ in range(4))
    selected_forward.launch(q, k, v, inverse, parts, torch.empty(B * G * T * n, H // G), 0.1, n)
    for partials, dq_add in ((False, False), (False, True), (True, False)):
        dq = torch.zeros(B, T, H, D) if dq_add else parts
        grads = torch.zeros(10, 64, D) if partials else torch.zeros(k.shape)
        selected_backward.launch(q, k, v, o, lse, lse, grads, grads, dq, inverse, 0.1, n, True, partials, dq_add)
    assert gluon_binds == ["_span_forward_kernel"] + ["_span_dkdv_kernel"] * 2 + ["_span_forward_kernel"] + [
        "_span_dkdv_kernel"] * 2 + ["_query_grad_kernel"] * 3 + ["_selected_forward_kernel"] + [
        "_selected_backward_kernel"] * 3


def gluon_sized_calls(monkeypatch) -> NSAGeometry:
    """Every size takes the Gluon kernels and the block-centric selected path (thresholds at 0); the selected
    branch's merge (a Triton kernel) does nothing. Returns M7C's geometry."""
    from nsa.ops.triton import selected_attention

    for field in ("tiled_max_blocks", "tiled_max_blocks_forward", "gluon_selected_forward_min_elements",
                  "gluon_selected_backward_min_elements", "gluon_span_min_elements"):
        monkeypatch.setattr(tuning.TUNING, field, 0)
    monkeypatch.setattr(selected_attention, "finalize", lambda *args, **kwargs: None)
    return NSAGeometry(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)


def test_dispatch_runs_each_stage_on_its_gluon_kernel_where_that_applies(gluon_binds, monkeypatch):
    # Where every Gluon kernel takes the call (as on an sm_90 GPU in bf16), each stage of the op launches it with
    # the buffers dispatch made (bound to the kernel's parameters by the stand-ins).
    from nsa.ops import dispatch
    from nsa.ops.branches import MODE_CMP, MODE_WIN, SEL_DENSE
    from nsa.ops.gluon import backward, forward, query_grad, selected_backward, selected_forward

    for module in (forward, backward, query_grad, selected_forward, selected_backward):
        monkeypatch.setattr(module, "supports", lambda *args: True)
    geometry = gluon_sized_calls(monkeypatch)
    B, T, H, G, D = 1, 300, 12, 2, 64
    q = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    k, v = torch.randn(B, T, G, D, dtype=torch.bfloat16), torch.randn(B, T, G, D, dtype=torch.bfloat16)
    lse, idx = torch.zeros(B, T, H), torch.zeros(B, T, G, geometry.n_sel, dtype=torch.int64)
    inverse = tuple(torch.zeros(10, dtype=torch.int32) for _ in range(4))
    o, lse_cmp = dispatch.span_forward(q, k, v, MODE_CMP, 0.1, geometry)
    dk, dv = dispatch.span_dkdv(q, k, v, o, lse, lse, MODE_WIN, 0.1, geometry)
    _, o_sel, _ = dispatch.selected_forward(q, k, v, idx, inverse, o, o, o[..., :3], 0.1, geometry)
    *_, sel = dispatch.selected_backward(q, k, v, idx, inverse, o, lse, lse, 0.1, geometry)
    dq = dispatch.query_grad(q, o, torch.zeros(3, B, T, H), torch.zeros(3, B, T, H), 0.1, geometry, (k, v), (k, v),
                             sel)
    assert sel.kind == SEL_DENSE and sel.dq.dtype == torch.float32  # the Gluon backward adds the rows' dQ
    assert (o.shape, o_sel.shape, dk.shape, dq.dtype) == (q.shape, q.shape, k.shape, q.dtype)
    assert gluon_binds == ["_span_forward_kernel", "_span_dkdv_kernel", "_selected_forward_kernel",
                           "_selected_backward_kernel", "_query_grad_kernel"]


def test_packed_calls_take_the_gluon_kernels_only_with_gluon_packed(gluon_binds, monkeypatch):
    # With TUNING.gluon_packed (and every Gluon kernel's own conditions met, as on an sm_90 GPU in bf16), each
    # stage of a packed call launches its Gluon kernel with the documents' tables (bound to the kernel's
    # parameters by the stand-ins); the tiled selected branch stays on Triton. Without it, none is launched.
    from nsa.ops import dispatch
    from nsa.ops.branches import MODE_CMP, MODE_SEL, MODE_WIN, SEL_DENSE
    from nsa.ops.geometry import compressed_offsets
    from nsa.ops.gluon import backward, forward, query_grad, selected_forward
    from nsa.ops.packing import packed_layout

    for module in (forward, backward, query_grad, selected_forward):  # the sm_90 check, on this CPU
        monkeypatch.setattr(module, "layout_ok", lambda *args: True)
    geometry = gluon_sized_calls(monkeypatch)
    T, H, G, D = 300, 12, 2, 64
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    C = int(compressed_offsets(cu, geometry)[-1])
    layout = packed_layout(cu, geometry, T, C)
    q = torch.randn(1, T, H, D, dtype=torch.bfloat16)
    k, v = torch.randn(1, T, G, D, dtype=torch.bfloat16), torch.randn(1, T, G, D, dtype=torch.bfloat16)
    k_cmp = torch.randn(1, C, G, D, dtype=torch.bfloat16)
    lse, idx = torch.zeros(1, T, H), torch.zeros(1, T, G, geometry.n_sel, dtype=torch.int64)
    inverse = tuple(torch.zeros(10, dtype=torch.int32) for _ in range(4))
    assert not forward.supports(q, k, v, MODE_SEL, 64, layout)  # the tiled selected branch: Triton's
    monkeypatch.setattr(tuning.TUNING, "gluon_packed", True)
    o, _ = dispatch.span_forward(q, k_cmp, k_cmp, MODE_CMP, 0.1, geometry, layout=layout)
    dispatch.span_forward(q, k, v, MODE_WIN, 0.1, geometry, layout=layout)
    dispatch.span_dkdv(q, k, v, o, lse, lse, MODE_WIN, 0.1, geometry, layout=layout)
    dispatch.selected_forward(q, k, v, idx, inverse, o, o, o[..., :3], 0.1, geometry, layout)
    *_, sel = dispatch.selected_backward(q, k, v, idx, inverse, o, lse, lse, 0.1, geometry, layout)
    dispatch.query_grad(q, o, torch.zeros(3, 1, T, H), torch.zeros(3, 1, T, H), 0.1, geometry, (k_cmp, k_cmp),
                        (k, v), sel, layout)
    assert sel.kind == SEL_DENSE
    assert gluon_binds == ["_span_forward_kernel"] * 2 + ["_span_dkdv_kernel", "_selected_forward_kernel",
                                                          "_selected_backward_kernel", "_query_grad_kernel"]
    gluon_binds.clear()
    monkeypatch.setattr(tuning.TUNING, "gluon_packed", False)
    dispatch.span_forward(q, k, v, MODE_WIN, 0.1, geometry, layout=layout)  # on Triton's kernel
    assert gluon_binds == []


def test_small_span_calls_stay_on_triton_below_the_gluon_threshold(gluon_binds, monkeypatch):
    # TUNING.gluon_span_min_elements: a call below it (host-bound when eager) runs Triton's span kernel even where
    # the Gluon one applies; from it on, Gluon's.
    from nsa.ops import dispatch
    from nsa.ops.branches import MODE_WIN
    from nsa.ops.gluon import forward

    monkeypatch.setattr(forward, "supports", lambda *args: True)
    geometry = NSAGeometry(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)
    q = torch.randn(1, 100, 4, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 100, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(tuning.TUNING, "gluon_span_min_elements", q.numel() + 1)
    dispatch.span_forward(q, k, v, MODE_WIN, 0.25, geometry)
    assert gluon_binds == []
    monkeypatch.setattr(tuning.TUNING, "gluon_span_min_elements", q.numel())
    dispatch.span_forward(q, k, v, MODE_WIN, 0.25, geometry)
    assert gluon_binds == ["_span_forward_kernel"]


def test_launchers_integer_helpers_agree_with_tritons():
    # The launchers' ceil_div / next_power_of_two stand in for triton.cdiv / triton.next_power_of_2 (constexpr
    # functions, slow on the host); every grid and tile width depends on them agreeing.
    import triton

    from nsa.ops.triton.common import ceil_div, next_power_of_two
    for n in range(0, 1100):
        assert next_power_of_two(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 1024):
            assert ceil_div(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_two(2**40 + 1) == 2**41
