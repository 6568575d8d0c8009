"""The Triton and Gluon kernels on a GPU at real shapes in bf16, and in float32 against float64 (skipped without
CUDA; benchmarks/gpu_check.sh runs them on a GPU)."""

import dataclasses

import pytest
import torch

from helpers import NAMES, assert_same_selection, nsa_inputs, tf32_matmuls
from nsa.ops import NSAGeometry, dispatch, nsa_attention, reference, select_blocks
from nsa.ops.branches import MODE_SEL
from nsa.ops.triton.inverse_index import build_inverse_index
from nsa.ops.triton.span_attention import chosen_bits
from nsa.ops.tuning import TUNING

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")

HP = dict(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)
GEOMETRY = NSAGeometry(**HP)
SELECT_HP = {k: HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")}
# name: (H, G, Dk, Dv)
SHAPES = {"m7c": (12, 2, 64, 64), "paper": (64, 4, 128, 128), "dk192": (16, 1, 192, 128), "d128": (8, 2, 128, 128)}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def assert_bf16_output_and_gradients(out, ins, ref, f32):
    """The bf16 kernels' output within 1e-2 and every gradient within 2e-2 (finite) of the float32 reference's."""
    assert rel_err(out, ref) < 1e-2
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, ins, do.to(torch.bfloat16))
    ref_grads = torch.autograd.grad(ref, f32, do)
    for grad_name, g, r in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(g).all(), grad_name
        assert rel_err(g, r) < 2e-2, (grad_name, rel_err(g, r))


def bf16_inputs(B, T, name, seed=0, requires_grad=True):
    H, G, Dk, Dv = SHAPES[name]
    ins = nsa_inputs(B, T, H, G, Dk, Dv, block_len=32, block_stride=16, seed=seed)
    return [t.cuda().to(torch.bfloat16).requires_grad_(requires_grad) for t in ins]


@pytest.mark.parametrize(
    "name,T",
    # M7C at 4000 tokens (63 blocks): the selected forward tiled, its backward block-centric.
    [("m7c", 1000), ("m7c", 2081), ("m7c", 4000), ("m7c", 8192), ("paper", 2048), ("paper", 8192), ("dk192", 4133)],
)
def test_bf16_kernels_match_the_float32_reference(name, T):
    ins = bf16_inputs(1, T, name, seed=T)
    idx = select_blocks(ins[0], ins[1], **SELECT_HP, backend="triton")
    f32 = [t.detach().float().requires_grad_() for t in ins]
    ref_idx = reference.select_blocks(f32[0], f32[1], **SELECT_HP)
    scores = reference.selection_scores(f32[0], f32[1], block_len=32, block_stride=16, sel_block=64)
    assert_same_selection(idx, ref_idx, scores, rtol=1e-3)
    assert (idx != ref_idx).any(-1).float().mean() < 0.01, "more than 1% of selections differ"

    out = nsa_attention(*ins, **HP, backend="triton")
    # Compare on the kernel's own selection so that near-tie swaps do not count as errors.
    ref = reference.nsa_attention(*f32, **HP, indices=idx)
    assert_bf16_output_and_gradients(out, ins, ref, f32)


@pytest.mark.parametrize(
    "name,T",
    # M7C at 4096 tokens (64 blocks): the selected forward tiled, its backward block-centric; groups of 16 (the
    # tiled path turned off): the selected forward and dQ per query. Short enough for the float64 reference.
    [("m7c", 4096), ("paper", 2048)],
)
def test_float32_kernels_match_the_float64_reference_unless_tf32_is_allowed(name, T, monkeypatch):
    # Float32 inputs multiply in float32 unless PyTorch allows TF32 (nsa.ops.triton.common.dot_precision): then the
    # output and every gradient are float32-accurate, and the selection is the float64 reference's except where two
    # blocks' scores tie within float32's resolution (these inputs hold such ties, within 1e-7). With TF32
    # allowed, the kernels multiply in TF32, like PyTorch's matmuls, to bf16's tolerances.
    if name == "paper":
        for field in ("tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
            monkeypatch.setattr(TUNING, field, 0)
    H, G, Dk, Dv = SHAPES[name]
    ins = [t.cuda().requires_grad_() for t in nsa_inputs(1, T, H, G, Dk, Dv, block_len=32, block_stride=16, seed=T)]
    f64 = [t.detach().double().requires_grad_() for t in ins]
    ref_idx = reference.select_blocks(f64[0], f64[1], **SELECT_HP)
    scores = reference.selection_scores(f64[0], f64[1], block_len=32, block_stride=16, sel_block=64)
    do = torch.randn(*ins[0].shape[:3], Dv, device="cuda", dtype=torch.float64)
    for tf32, sel_tol, out_tol, grad_tol in ((False, 1e-5, 1e-4, 1e-4), (True, 1e-3, 1e-2, 2e-2)):
        with tf32_matmuls(tf32):
            idx = select_blocks(ins[0], ins[1], **SELECT_HP, backend="triton")
            out = nsa_attention(*ins, **HP, backend="triton")
            grads = torch.autograd.grad(out, ins, do.float())
        assert_same_selection(idx, ref_idx, scores, rtol=sel_tol)
        assert (idx != ref_idx).any(-1).float().mean() < 0.01, "more than 1% of selections differ"
        # On the kernel's own selection, so that a swap of near-tied blocks does not count as an error.
        ref = reference.nsa_attention(*f64, **HP, indices=idx)
        assert rel_err(out, ref) < out_tol, (tf32, rel_err(out, ref))
        for grad_name, g, r in zip(NAMES, grads, torch.autograd.grad(ref, f64, do)):
            assert torch.isfinite(g).all(), (tf32, grad_name)
            assert rel_err(g, r) < grad_tol, (tf32, grad_name, rel_err(g, r))


@pytest.mark.parametrize("name,B,T", [("m7c", 4, 8192), ("m7c", 1, 65536), ("paper", 1, 16384)])
def test_deterministic_mode_repeats_every_gradient_bit_for_bit(name, B, T):
    # The Gluon kernels serve these sizes (>= 2^24 elements of q on sm_90), with split dK/dV rows and blocks of
    # several work items; deterministic mode must give the same bits twice, and the atomic path's numbers.
    ins = bf16_inputs(B, T, name, seed=T)
    out = nsa_attention(*ins, **HP, backend="triton")
    do = torch.randn_like(out)
    atomic = torch.autograd.grad(out, ins, do)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(nsa_attention(*ins, **HP, backend="triton"), ins, do) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for grad_name, g, again, a in zip(NAMES, *runs, atomic):
        assert torch.equal(g, again), f"d{grad_name} differs between two deterministic runs"
        assert rel_err(g, a) < 1e-2, (grad_name, rel_err(g, a))


def branch_inputs(name, T, mode):
    """(q, k, v, chosen bits or None, gates) of one span branch on two sequences of bf16 inputs, the raw keys and
    values as the model hands them over: views into one wider projection."""
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = bf16_inputs(2, T, name, seed=T + mode, requires_grad=False)
    k_sel, v_sel, k_win, v_win = torch.stack([k_sel, v_sel, k_win, v_win], dim=2).unbind(2)
    k, v = [(k_cmp, v_cmp), (k_win, v_win), (k_sel, v_sel)][mode]
    bits = None
    if mode == MODE_SEL:
        idx = select_blocks(q, k_cmp, **SELECT_HP, backend="triton")
        bits = chosen_bits(idx, -(-T // HP["sel_block"]))
    return q, k, v, bits, gates


@pytest.mark.parametrize("name,T", [("m7c", 2081), ("m7c", 700), ("paper", 2048)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_gluon_forward_matches_the_triton_kernel(name, T, mode, monkeypatch):
    # The Gluon forward (nsa.ops.gluon.forward) has no CPU interpreter: here it meets the Triton kernel the CPU
    # tests check, branch by branch, two sequences (offsets past the first), odd lengths, the gated sum.
    from nsa.ops.gluon import forward as gluon_forward

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is built for sm_90")
    monkeypatch.setattr(TUNING, "gluon_span_min_elements", 0)  # short calls take it too
    q, k, v, bits, gates = branch_inputs(name, T, mode)
    o_cmp, o_win = torch.randn_like(q), torch.randn_like(q)
    gated = (o_cmp, o_win, gates) if mode == MODE_SEL else None
    assert gluon_forward.supports(q, k, v, mode, HP["sel_block"])

    def run():
        return dispatch.span_forward(q, k, v, mode, q.shape[-1] ** -0.5, GEOMETRY, bits, gated)

    gluon = run()
    monkeypatch.setattr(TUNING, "gluon_forward", False)
    triton_ = run()
    for a, b in zip(gluon, triton_):
        if a.dtype == torch.float32:  # lse: -inf for the same rows (none visible), close elsewhere
            assert torch.equal(torch.isinf(a), torch.isinf(b))
            torch.testing.assert_close(a[torch.isfinite(b)], b[torch.isfinite(b)], rtol=0, atol=2e-3)
        else:
            assert rel_err(a, b) < 5e-3, rel_err(a, b)


@pytest.mark.parametrize("name,T", [("m7c", 2081), ("m7c", 700), ("paper", 2048)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_gluon_dkdv_matches_the_triton_kernel(name, T, mode, monkeypatch):
    # The Gluon dK/dV kernel (nsa.ops.gluon.backward) against the Triton one the CPU tests check: each branch, two
    # sequences, odd lengths, keys and values as views into one projection, row splits added atomically.
    from nsa.ops.gluon import backward as gluon_backward

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon dK/dV kernel is built for sm_90")
    monkeypatch.setattr(TUNING, "gluon_span_min_elements", 0)
    q, k, v, bits, _ = branch_inputs(name, T, mode)
    scale = q.shape[-1] ** -0.5
    o, lse = dispatch.span_forward(q, k, v, mode, scale, GEOMETRY, bits)
    do = torch.randn_like(o)
    delta = (do.float() * o.float()).sum(-1)
    assert gluon_backward.supports(q, k, v, do, mode, HP["sel_block"])
    gluon = dispatch.span_dkdv(q, k, v, do, lse, delta, mode, scale, GEOMETRY, bits)
    monkeypatch.setattr(TUNING, "gluon_backward", False)
    triton_ = dispatch.span_dkdv(q, k, v, do, lse, delta, mode, scale, GEOMETRY, bits)
    for grad_name, a, b in zip(("dk", "dv"), gluon, triton_):
        assert torch.isfinite(a).all(), grad_name
        assert rel_err(a, b) < 5e-3, (grad_name, rel_err(a, b))


def gathered_selected_inputs(name, T, monkeypatch):
    """(q, k, v, gates, indices, inverse index) of the block-centric selected branch on two bf16 sequences, keys and
    values as views into one projection, short sequences forced off the tiled path; skips off sm_90."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
        monkeypatch.setattr(TUNING, field, 0)
    q, k_cmp, _, k_sel, v_sel, k_win, v_win, gates = bf16_inputs(2, T, name, seed=T, requires_grad=False)
    k, v = torch.stack([k_sel, v_sel, k_win, v_win], dim=2).unbind(2)[:2]
    idx = select_blocks(q, k_cmp, **SELECT_HP, backend="triton")
    return q, k, v, gates, idx, build_inverse_index(idx, T, HP["sel_block"])


def gluon_and_triton(monkeypatch, module, switch, call):
    """{True: call() with the Gluon kernel, False: with Triton's}, asserting that the Gluon kernel's launch (in
    `module`, of nsa.ops.gluon) ran exactly once."""
    calls = []
    original = module.launch
    monkeypatch.setattr(module, "launch", lambda *a, **kw: (calls.append(1), original(*a, **kw))[1])
    runs = {}
    for gluon in (True, False):
        monkeypatch.setattr(TUNING, switch, gluon)
        runs[gluon] = call()
    assert calls == [1], "the Gluon kernel did not run (or ran twice)"
    return runs


@pytest.mark.parametrize("name,T", [("m7c", 4133), ("m7c", 700), ("m7c", 129), ("d128", 2500)])
def test_gluon_selected_forward_matches_the_triton_kernel(name, T, monkeypatch):
    # The Gluon block-centric selected forward (nsa.ops.gluon.selected_forward) against the Triton kernel the CPU
    # tests check, through the finalize merge: o_sel, its lse and the gated sum; M7C's group of 6 and a group of 4 at
    # head dim 128, a last partial block.
    from nsa.ops.gluon import selected_forward as gluon_selected_forward

    monkeypatch.setattr(TUNING, "gluon_selected_forward_min_elements", 0)
    q, k, v, gates, idx, inverse = gathered_selected_inputs(name, T, monkeypatch)
    o_cmp, o_win = torch.randn_like(q), torch.randn_like(q)
    runs = gluon_and_triton(monkeypatch, gluon_selected_forward, "gluon_selected_forward", lambda: (
        dispatch.selected_forward(q, k, v, idx, inverse, o_cmp, o_win, gates, q.shape[-1] ** -0.5, GEOMETRY)))
    for out_name, a, b in zip(("o", "o_sel", "lse_sel"), runs[True], runs[False]):
        assert torch.isfinite(a).all(), out_name
        assert rel_err(a, b) < 5e-3, (out_name, rel_err(a, b))


@pytest.mark.parametrize("name,T", [("m7c", 4133), ("m7c", 700), ("paper", 4500), ("paper", 2048)])
def test_gluon_selected_backward_matches_the_triton_kernel(name, T, monkeypatch):
    # The Gluon block-centric selected backward (nsa.ops.gluon.selected_backward) against the Triton kernel the CPU
    # tests check: dK/dV and, at M7C's group of 6, the rows' dQ shares; a last partial block (700, 4133, 4500).
    from nsa.ops.gluon import selected_backward as gluon_selected_backward

    monkeypatch.setattr(TUNING, "gluon_selected_backward_min_elements", 0)
    q, k, v, gates, idx, inverse = gathered_selected_inputs(name, T, monkeypatch)
    scale = q.shape[-1] ** -0.5
    _, o_sel, lse = dispatch.selected_forward(q, k, v, idx, inverse, torch.randn_like(q), torch.randn_like(q), gates,
                                              scale, GEOMETRY)
    do = torch.randn_like(o_sel)
    delta = (do.float() * o_sel.float()).sum(-1)
    runs = gluon_and_triton(monkeypatch, gluon_selected_backward, "gluon_selected_backward", lambda: (
        dispatch.selected_backward(q, k, v, idx, inverse, do, lse, delta, scale, GEOMETRY)))
    (dk, dv, sel), (dk_t, dv_t, sel_t) = runs[True], runs[False]
    for grad_name, a, b in (("dk", dk, dk_t), ("dv", dv, dv_t)):
        assert torch.isfinite(a).all(), grad_name
        assert rel_err(a, b) < 5e-3, (grad_name, rel_err(a, b))
    if sel_t.parts is not None:
        # The Triton kernel writes a dQ share per (query, slot, head); the Gluon one adds them into one float32 dQ
        # (outside deterministic mode). Their sums over the used slots must agree.
        assert sel.dq is not None and sel.parts is None, "the Gluon kernel did not add the rows' dQ"
        assert rel_err(sel.dq, sel_t.dense()) < 5e-3, rel_err(sel.dq, sel_t.dense())


@pytest.mark.parametrize("name,T", [("m7c", 2081), ("m7c", 700), ("m7c", 4133), ("paper", 2048), ("paper", 4500)])
def test_gluon_query_grad_matches_the_triton_kernel(name, T, monkeypatch):
    # The Gluon dQ kernel (nsa.ops.gluon.query_grad) against the Triton one inside a whole backward: the selected
    # branch's share tiled (short T), as block-centric partials (M7C at 4k) and as a per-query dQ (paper at 4.5k).
    from nsa.ops.gluon import query_grad as gluon_query_grad

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon dQ kernel is built for sm_90")
    monkeypatch.setattr(TUNING, "gluon_span_min_elements", 0)
    calls = []
    original = gluon_query_grad.launch
    monkeypatch.setattr(gluon_query_grad, "launch", lambda *a, **k: (calls.append(a[9].kind), original(*a, **k))[1])
    ins = bf16_inputs(2, T, name, seed=T)
    do = torch.randn(ins[0].shape[:3] + (ins[4].shape[-1],), device="cuda", dtype=torch.bfloat16)
    grads = {}
    for gluon in (True, False):
        monkeypatch.setattr(TUNING, "gluon_query_grad", gluon)
        out = nsa_attention(*ins, **HP, backend="triton")
        grads[gluon] = torch.autograd.grad(out, ins[0], do)[0]
    assert calls, "the Gluon dQ kernel did not run"
    assert torch.isfinite(grads[True]).all()
    assert rel_err(grads[True], grads[False]) < 5e-3, rel_err(grads[True], grads[False])


@pytest.mark.parametrize("T", [65536, 131072])
def test_long_sequences_stay_finite_and_agree_with_their_prefix(T, monkeypatch):
    # The prefix must take the long run's selected-branch path (a 4096-token run would be tiled) to match bit for bit.
    monkeypatch.setattr(TUNING, "tiled_max_blocks", 0)  # M7C's group of 6 uses this threshold
    monkeypatch.setattr(TUNING, "tiled_max_blocks_forward", 0)
    ins = bf16_inputs(1, T, "m7c", seed=1)
    out = nsa_attention(*ins, **HP, backend="triton")
    assert torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    for name, t in zip(NAMES, ins):
        assert torch.isfinite(t.grad).all(), name
    # Causality: the first 4096 outputs of the long run equal a 4096-token run.
    n = 4096
    nc = (n - 32) // 16 + 1
    short = [ins[0][:, :n], ins[1][:, :nc], ins[2][:, :nc]] + [t[:, :n] for t in ins[3:]]
    torch.testing.assert_close(out[:, :n], nsa_attention(*short, **HP, backend="triton"), rtol=0, atol=0)


@pytest.mark.parametrize("B,T", [(8, 2048), (1, 8192)])
def test_branch_streams_change_no_number(B, T, monkeypatch):
    """The compressed (and window) branch on a side stream: the same output and gradients as all on one stream, over
    repeated steps (a missing wait would read a branch's output before it is written)."""
    ins = bf16_inputs(B, T, "m7c", seed=B)
    do = torch.randn_like(ins[0][..., :64])
    monkeypatch.setattr(TUNING, "branch_streams_min_elements", 0)  # these calls are smaller than the default's

    def steps(on: bool):
        monkeypatch.setattr(TUNING, "branch_streams", on)
        assert dispatch.side_stream(ins[0]).on == on
        results = []
        for _ in range(3):
            out = nsa_attention(*ins, **HP, backend="triton")
            results.append((out, *torch.autograd.grad(out, ins, do)))
        return results

    for one, side in zip(steps(False), steps(True)):
        torch.testing.assert_close(side[0], one[0], rtol=0, atol=0)
        for grad_name, g, r in zip(("o",) + NAMES, side, one):
            # split dK/dV programs add in whatever order they finish, the same on either side
            assert rel_err(g, r) < 1e-3, (grad_name, rel_err(g, r))


@pytest.mark.parametrize("B,T,name", [(1, 4096, "m7c"), (8, 2048, "m7c"), (1, 4096, "paper")])
def test_branch_streams_inside_a_captured_cuda_graph(B, T, name, monkeypatch):
    """Captured in a CUDA graph, the branches fork to the side stream at any size; replays on new inputs give the
    one-stream eager numbers (a missing edge would let a replay read a branch's output before it is written, or
    let the side stream overwrite memory the main stream still reads)."""
    static = bf16_inputs(B, T, name, seed=1)
    do = torch.randn_like(static[0][..., :SHAPES[name][3]])
    forks = []
    side_stream = dispatch.side_stream

    def spy(q):
        side = side_stream(q)
        forks.append(side.on)
        return side

    def step():
        out = nsa_attention(*static, **HP, backend="triton")
        return (out, *torch.autograd.grad(out, static, do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.setattr(dispatch, "side_stream", spy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert forks == [True, True], "the forward and backward forked to the side stream while captured"
    monkeypatch.setattr(dispatch, "side_stream", side_stream)
    monkeypatch.setattr(TUNING, "branch_streams", False)
    for seed in (2, 3):
        fresh = bf16_inputs(B, T, name, seed=seed)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        eager = step()
        torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=0)
        for grad_name, g, r in zip(NAMES, captured[1:], eager[1:]):
            # split dK/dV programs add in whatever order they finish
            assert rel_err(g, r) < 1e-3, (seed, grad_name, rel_err(g, r))


def test_int64_offsets_beyond_two_billion_elements():
    # B=2 at 128k tokens x 64 heads x 128 dims: element offsets of the second sequence exceed 2^31.
    ins = bf16_inputs(2, 131072, "paper", seed=2, requires_grad=False)
    with torch.no_grad():
        both = nsa_attention(*ins, **HP, backend="triton")
        second = nsa_attention(*[t[1:] for t in ins], **HP, backend="triton")
    assert torch.isfinite(both).all()
    torch.testing.assert_close(both[1:], second, rtol=0, atol=0)


def test_torch_compile_keeps_one_graph_and_the_same_numbers():
    from nsa.model import Transformer, tiny

    ins = bf16_inputs(1, 1500, "m7c", seed=3)

    def f(*xs):
        return nsa_attention(*xs, **HP)

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(*ins), f(*ins), rtol=0, atol=0)
    cfg = dataclasses.replace(tiny(), vocab_size=320)
    model = Transformer(cfg).cuda()
    tokens = torch.randint(0, 320, (2, 257), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(tokens[:, :-1], tokens[:, 1:])
        compiled_model = torch.compile(model, fullgraph=True)
        loss = compiled_model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-3)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_model_under_autocast_matches_the_reference_backend():
    from nsa.model import Transformer, tiny

    cfg = dataclasses.replace(tiny(), vocab_size=320)
    torch.manual_seed(0)
    fast = Transformer(cfg).cuda()
    slow = Transformer(dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, backend="reference"))).cuda()
    slow.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 320, (2, 600), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = fast(tokens[:, :-1], tokens[:, 1:])
        b = slow(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("B,T", [(4, 2048), (2, 2081), (1, 32768)])
def test_phi_kernels_in_bf16_match_the_float32_module(B, T):
    """phi's MLP at M7C's shape (l 32, d 16, D 64, hidden 128) on the kernels in bf16 against the PyTorch module in
    float32: output and every gradient; then compiled, the same bits as eager."""
    from nsa.model.compression import BlockCompressor

    torch.manual_seed(T)
    ref = BlockCompressor(64, 32, 16, "mlp", 128, backend="reference").cuda()
    for w in (ref.pos, ref.fc1.weight, ref.fc2.weight):  # fc2 starts at zero: randomise so the MLP counts
        torch.nn.init.normal_(w, std=0.05)
    fast = BlockCompressor(64, 32, 16, "mlp", 128, backend="triton").cuda()
    fast.load_state_dict(ref.state_dict())
    x32 = torch.randn(B, T, 3, 2, 64, device="cuda")[:, :, 0].requires_grad_()
    x = x32.detach().bfloat16().requires_grad_()
    want, got = ref(x32), fast(x)
    assert rel_err(got, want) < 1e-2
    w = torch.randn_like(want)
    params = [fast.pos, fast.fc1.weight, fast.fc2.weight]
    got_grads = torch.autograd.grad((got.float() * w).sum(), [x, *params])
    want_grads = torch.autograd.grad((want * w).sum(), [x32, ref.pos, ref.fc1.weight, ref.fc2.weight])
    for name, g, r in zip(("x", "pos", "fc1", "fc2"), got_grads, want_grads):
        assert rel_err(g, r) < 2e-2, name
    compiled = torch.compile(fast, fullgraph=True)
    torch.testing.assert_close(compiled(x), got, rtol=0, atol=0)


def test_phi_kernels_in_float32_match_the_float64_module():
    """phi's MLP at M7C's shape in float32 with TF32 off against the module in float64: float32 accuracy (its
    float32 tiles must also fit sm_90's shared memory: the backward's token kernel runs one pipeline stage)."""
    from nsa.model.compression import BlockCompressor

    torch.manual_seed(0)
    ref = BlockCompressor(64, 32, 16, "mlp", 128, backend="reference").cuda().double()
    for w in (ref.pos, ref.fc1.weight, ref.fc2.weight):
        torch.nn.init.normal_(w, std=0.05)
    fast = BlockCompressor(64, 32, 16, "mlp", 128, backend="triton").cuda()
    fast.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x64 = torch.randn(2, 2081, 2, 64, device="cuda", dtype=torch.float64).requires_grad_()
    x = x64.detach().float().requires_grad_()
    with tf32_matmuls(False):
        got = fast(x)
        w = torch.randn_like(got)
        got_grads = torch.autograd.grad((got * w).sum(), [x, fast.pos, fast.fc1.weight, fast.fc2.weight])
    want = ref(x64)
    want_grads = torch.autograd.grad((want * w.double()).sum(), [x64, ref.pos, ref.fc1.weight, ref.fc2.weight])
    assert rel_err(got, want) < 1e-4, rel_err(got, want)
    for name, g, r in zip(("x", "pos", "fc1", "fc2"), got_grads, want_grads):
        assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))


def document_lengths(total, longest, seed):
    """Lengths drawn between 1 and `longest` tokens, summing to total, then two empty padding documents."""
    return drawn_lengths(total, longest, seed) + [0, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_phi_kernels_in_bf16_match_the_float32_module(seed):
    """phi's MLP at M7C's shape on packed documents (1 to 4k tokens, 16k in all): keys and values in one launch on
    the kernels in bf16 against the PyTorch packed path in float32, output and every gradient; compiled, the same
    bits as eager; one document, the unpacked kernels' bits."""
    from nsa.model.compression import BlockCompressor, compress_pair

    torch.manual_seed(seed)
    refs = [BlockCompressor(64, 32, 16, "mlp", 128, backend="reference").cuda() for _ in range(2)]
    fasts = [BlockCompressor(64, 32, 16, "mlp", 128, backend="triton").cuda() for _ in range(2)]
    for ref, fast in zip(refs, fasts):
        for w in ref.mlp_weights:
            torch.nn.init.normal_(w, std=0.05)
        fast.load_state_dict(ref.state_dict())
    lengths = document_lengths(16384, 4096, seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kv32 = torch.randn(1, 16384, 3, 2, 64, device="cuda")
    x32, y32 = (kv32[:, :, i].requires_grad_() for i in (0, 1))
    x, y = (t.detach().bfloat16().requires_grad_() for t in (x32, y32))
    want = [ref(t, cu) for ref, t in zip(refs, (x32, y32))]
    got = compress_pair(*fasts, x, y, cu)
    weights = [torch.randn_like(w) for w in want]
    params = [x, y, *fasts[0].mlp_weights, *fasts[1].mlp_weights]
    ref_params = [x32, y32, *refs[0].mlp_weights, *refs[1].mlp_weights]
    got_grads = torch.autograd.grad(sum((o.float() * w).sum() for o, w in zip(got, weights)), params)
    want_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), ref_params)
    for o, w in zip(got, want):
        assert rel_err(o, w) < 1e-2
    for name, g, r in zip(("x", "y", "pos_k", "fc1_k", "fc2_k", "pos_v", "fc1_v", "fc2_v"), got_grads, want_grads):
        assert rel_err(g, r) < 2e-2, name
    compiled = torch.compile(fasts[0], fullgraph=True)
    torch.testing.assert_close(compiled(x, cu), got[0], rtol=0, atol=0)
    one = torch.tensor([0, 16384], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(fasts[0](x, one), fasts[0](x), rtol=0, atol=0)


def packed_stream(lengths, name, seed=0):
    """q [1,total,H,Dk], k_cmp [1,Nc(total),G,Dk], k, v [1,total,G,D] (bf16) and cu_seqlens (int32, a trailing
    empty document as padding) of one packed stream, with each token's compressed log-sum-exp [1,total,H] (float32)
    over its own document's compressed tokens."""
    H, G, Dk, Dv = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    q, k_cmp = rnd(1, total, H, Dk), rnd(1, GEOMETRY.num_compressed_blocks(total), G, Dk)
    k, v = rnd(1, total, G, Dk), rnd(1, total, G, Dv)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), total], dtype=torch.int32, device="cuda")
    lse = torch.full(q.shape[:3], float("-inf"), device="cuda")
    for (a, b), (r0, r1) in packed_documents(cu):
        s = torch.einsum("thd,nhd->thn", q[0, a:b].float(), k_cmp[0, r0:r1].float().repeat_interleave(H // G, 1))
        ends = torch.arange(r1 - r0, device="cuda") * HP["block_stride"] + HP["block_len"] - 1
        visible = ends <= torch.arange(b - a, device="cuda")[:, None, None]
        lse[0, a:b] = torch.logsumexp((s * Dk**-0.5).masked_fill(~visible, float("-inf")), -1)
    return q, k_cmp, k, v, cu, lse


def packed_documents(cu):
    """((first token, end), (first compressed row, end)) of each non-empty document of cu."""
    from nsa.ops import compressed_offsets

    bounds, offsets = cu.tolist(), compressed_offsets(cu, GEOMETRY).tolist()
    return [((a, b), (offsets[i], offsets[i + 1])) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]


def drawn_lengths(total, longest, seed):
    """Document lengths drawn between 1 and `longest` tokens, totalling `total`."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), total - sum(lengths)))
    return lengths


def packed_selected(q, k, v, idx, cu, do):
    """(o_sel, dQ, dK, dV) of the packed selected branch through dispatch (gates at 1, no other branch)."""
    from nsa.ops.packing import packed_layout

    layout = packed_layout(cu, GEOMETRY, q.shape[1], 0)
    inverse = build_inverse_index(idx, q.shape[1], HP["sel_block"], layout)
    scale = q.shape[-1] ** -0.5
    zeros, gates = torch.zeros_like(q), torch.ones(*q.shape[:3], 3, device="cuda", dtype=q.dtype)
    _, o_sel, lse = dispatch.selected_forward(q, k, v, idx, inverse, zeros, zeros, gates, scale, GEOMETRY, layout)
    delta = (do.float() * o_sel.float()).sum(-1)
    dk, dv, sel = dispatch.selected_backward(q, k, v, idx, inverse, do, lse, delta, scale, GEOMETRY, layout)
    return o_sel, sel.dense(), dk, dv


@pytest.fixture(params=["token", "blocks"])
def packed_gathered_path(request, monkeypatch):
    """The packed selected branch per query or block-centric (never tiled)."""
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
        monkeypatch.setattr(TUNING, field, 0)
    monkeypatch.setattr(TUNING, "token_min_heads", 1 if request.param == "token" else 10**9)
    return request.param


def test_packed_selection_and_selected_branch_match_each_document_alone(packed_gathered_path):
    # M7C with documents of 1 to 4k tokens totalling 16k: the selection against the float32 reference per document,
    # then the selected branch on the kernel's own choice, output and every gradient.
    from nsa.ops.packing import packed_layout
    from nsa.ops.triton.selection import select_blocks_fwd

    q, k_cmp, k, v, cu, lse = packed_stream(drawn_lengths(16384, 4096, seed=0), "m7c", seed=1)
    scale = q.shape[-1] ** -0.5
    idx = select_blocks_fwd(q, k_cmp, lse, scale, GEOMETRY, packed_layout(cu, GEOMETRY, q.shape[1], k_cmp.shape[1]))
    do = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda", dtype=torch.bfloat16)
    got = packed_selected(q, k, v, idx, cu, do)
    differ = 0
    for (a, b), (r0, r1) in packed_documents(cu):
        f32 = [x[:, a:b].float().requires_grad_() for x in (q, k, v)]
        scores = reference.selection_scores(f32[0], k_cmp[:, r0:r1].float(), block_len=32, block_stride=16,
                                            sel_block=64, scale=scale)
        want_idx = reference.top_n_blocks(scores, sel_block=64, n_sel=16)
        assert_same_selection(idx[:, a:b], want_idx, scores, rtol=1e-3)
        differ += (idx[:, a:b] != want_idx).any(-1).sum().item()
        want = reference.selected_attention(*f32, idx[:, a:b], sel_block=64, scale=scale)
        wants = (want, *torch.autograd.grad(want, f32, do[:, a:b].float()))
        for out_name, x, w in zip(("o_sel", "dq", "dk", "dv"), got, wants):
            assert torch.isfinite(x[:, a:b]).all(), out_name
            assert rel_err(x[:, a:b], w) < 2e-2, (out_name, a, b, rel_err(x[:, a:b], w))
    assert differ < 0.01 * idx[..., 0].numel(), "more than 1% of selections differ"


def test_one_packed_document_is_the_unpacked_call(packed_gathered_path):
    from nsa.ops.packing import packed_layout
    from nsa.ops.triton.selection import select_blocks_fwd

    q, k_cmp, k, v, cu, lse = packed_stream([4133], "m7c", seed=2)
    T, scale = q.shape[1], q.shape[-1] ** -0.5
    idx = select_blocks_fwd(q, k_cmp, lse, scale, GEOMETRY)
    layout = packed_layout(cu, GEOMETRY, T, k_cmp.shape[1])
    assert torch.equal(select_blocks_fwd(q, k_cmp, lse, scale, GEOMETRY, layout), idx)
    do = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda", dtype=torch.bfloat16)
    packed = packed_selected(q, k, v, idx, cu, do)
    with pytest.MonkeyPatch.context() as mp:
        for field in ("gluon_selected_forward", "gluon_selected_backward"):  # the unpacked call on Triton's kernels
            mp.setattr(TUNING, field, False)
        unpacked_inverse = build_inverse_index(idx, T, HP["sel_block"])
        zeros, gates = torch.zeros_like(q), torch.ones(*q.shape[:3], 3, device="cuda", dtype=q.dtype)
        _, o_sel, lse_sel = dispatch.selected_forward(q, k, v, idx, unpacked_inverse, zeros, zeros, gates, scale,
                                                      GEOMETRY)
        delta = (do.float() * o_sel.float()).sum(-1)
        dk, dv, sel = dispatch.selected_backward(q, k, v, idx, unpacked_inverse, do, lse_sel, delta, scale,
                                                 GEOMETRY)
    torch.testing.assert_close(packed[0], o_sel, rtol=0, atol=0)
    for out_name, x, w in zip(("dq", "dk", "dv"), packed[1:], (sel.dense(), dk, dv)):
        torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{out_name}: {m}")


# ---------------------------------------------------------------- packed documents


def varied_document_lengths(total, longest, seed):
    """Lengths between 1 and `longest` tokens filling `total` (after a 1-token, a sub-block and a non-multiple
    document), then two empty documents (padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 31, 100]
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), total - sum(lengths)))
    return lengths + [0, 0]


def packed_bf16_inputs(name, lengths, seed=0):
    """q, k_cmp (Nc(total) rows), v_cmp, k_sel, v_sel, k_win, v_win, gates of one packed stream in bf16, and
    cu_seqlens."""
    H, G, Dk, Dv = SHAPES[name]
    total = sum(lengths)
    ins = nsa_inputs(1, total, H, G, Dk, Dv, block_len=32, block_stride=16, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return [t.cuda().to(torch.bfloat16).requires_grad_() for t in ins], cu


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["cmp", "win", "sel"])
def test_packed_span_stages_in_bf16_match_the_float32_reference_per_document(mode):
    from helpers import packed_branch_kernels, packed_branch_reference
    from nsa.ops.packing import packed_layout

    # The tiled selected branch holds at most 64 selection blocks: 4096 tokens for it, 16k for the others.
    lengths = varied_document_lengths(4096 if mode == MODE_SEL else 16384, 4096, seed=mode)
    ins, cu = packed_bf16_inputs("m7c", lengths, seed=mode)
    q, k, v = (ins[0], ins[1], ins[2]) if mode == 0 else (ins[0], ins[3 + 2 * (mode == 1)], ins[4 + 2 * (mode == 1)])
    f32 = [t.detach().float() for t in (q, k, v)]
    indices = None
    if mode == MODE_SEL:
        indices = reference.select_blocks(f32[0], ins[1].detach().float(), **SELECT_HP, cu_seqlens=cu)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    scale = q.shape[-1] ** -0.5
    layout = packed_layout(cu, GEOMETRY, q.shape[1], ins[1].shape[1])
    out, grads = packed_branch_kernels(mode, GEOMETRY, scale, q.detach(), k.detach(), v.detach(), indices,
                                       do.to(torch.bfloat16), layout)
    want, want_grads = packed_branch_reference(mode, GEOMETRY, scale, *f32, indices, do, cu)
    assert rel_err(out, want) < 1e-2
    for grad_name, g, r in zip(("dq", "dk", "dv"), grads, want_grads):
        assert torch.isfinite(g).all(), grad_name
        assert rel_err(g, r) < 2e-2, (grad_name, rel_err(g, r))


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_packed_bf16_kernels_match_the_float32_reference_per_document(gluon, monkeypatch):
    # With gluon, packed calls take the Gluon kernels where they apply (TUNING.gluon_packed; sm_90 only).
    monkeypatch.setattr(TUNING, "gluon_packed", gluon)
    ins, cu = packed_bf16_inputs("m7c", varied_document_lengths(16384, 4096, seed=7), seed=7)
    idx = select_blocks(ins[0], ins[1], **SELECT_HP, cu_seqlens=cu, backend="triton")
    f32 = [t.detach().float().requires_grad_() for t in ins]
    ref_idx = reference.select_blocks(f32[0], f32[1], **SELECT_HP, cu_seqlens=cu)
    assert (idx != ref_idx).any(-1).float().mean() < 0.01, "more than 1% of selections differ"

    out = nsa_attention(*ins, **HP, cu_seqlens=cu, backend="triton")
    ref = reference.nsa_attention(*f32, **HP, indices=idx, cu_seqlens=cu)
    assert_bf16_output_and_gradients(out, ins, ref, f32)


@pytest.mark.parametrize("T", [700, 4133])
def test_one_packed_document_is_the_unpacked_nsa_call(T):
    ins = bf16_inputs(1, T, "m7c", seed=T)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    idx = select_blocks(ins[0], ins[1], **SELECT_HP, backend="triton")
    assert torch.equal(select_blocks(ins[0], ins[1], **SELECT_HP, cu_seqlens=cu, backend="triton"), idx)
    out = nsa_attention(*ins, **HP, backend="triton")
    packed = nsa_attention(*ins, **HP, cu_seqlens=cu, backend="triton")
    assert rel_err(packed, out) < 1e-2
    do = torch.randn_like(out)
    for grad_name, g, r in zip(NAMES, torch.autograd.grad(packed, ins, do), torch.autograd.grad(out, ins, do)):
        assert rel_err(g, r) < 2e-2, (grad_name, rel_err(g, r))


def packed_gluon_inputs(seed):
    """The bf16 inputs (detached) and cu_seqlens of a packed M7C stream of 16k tokens (documents of 1 to 4k tokens,
    a 1-token, a sub-block and a non-multiple one, two empty ones) with its PackedLayout; skips off sm_90."""
    from nsa.ops.packing import packed_layout

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    ins, cu = packed_bf16_inputs("m7c", varied_document_lengths(16384, 4096, seed=seed), seed=seed)
    ins = [t.detach() for t in ins]
    return ins, cu, packed_layout(cu, GEOMETRY, ins[0].shape[1], ins[1].shape[1])


@pytest.fixture
def gluon_packed(monkeypatch):
    """Packed calls may take the Gluon kernels (TUNING.gluon_packed), at any size."""
    monkeypatch.setattr(TUNING, "gluon_packed", True)
    monkeypatch.setattr(TUNING, "gluon_span_min_elements", 0)


@pytest.mark.parametrize("mode", [0, 1], ids=["cmp", "win"])
def test_gluon_span_kernels_on_packed_documents_match_the_triton_kernels(mode, gluon_packed, monkeypatch):
    # The Gluon span forward and dK/dV kernels with PACKED on, against the Triton kernels the CPU tests check on
    # packed documents: output, lse (-inf for the same rows: tokens before their document's first compressed
    # token), dK and dV, every Gluon launch counted.
    from nsa.ops.gluon import backward as gluon_backward
    from nsa.ops.gluon import forward as gluon_forward

    ins, _, layout = packed_gluon_inputs(seed=11 + mode)
    q, k, v = (ins[0], ins[1], ins[2]) if mode == 0 else (ins[0], ins[5], ins[6])
    scale = q.shape[-1] ** -0.5
    fwd = gluon_and_triton(monkeypatch, gluon_forward, "gluon_forward", lambda: (
        dispatch.span_forward(q, k, v, mode, scale, GEOMETRY, None, None, layout)))
    (o, lse), (o_t, lse_t) = fwd[True], fwd[False]
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_t))
    torch.testing.assert_close(lse[torch.isfinite(lse_t)], lse_t[torch.isfinite(lse_t)], rtol=0, atol=2e-3)
    assert rel_err(o, o_t) < 5e-3, rel_err(o, o_t)
    do = torch.randn_like(o_t)
    delta = (do.float() * o_t.float()).sum(-1)
    bwd = gluon_and_triton(monkeypatch, gluon_backward, "gluon_backward", lambda: (
        dispatch.span_dkdv(q, k, v, do, lse_t, delta, mode, scale, GEOMETRY, None, layout)))
    for grad_name, a, b in zip(("dk", "dv"), bwd[True], bwd[False]):
        assert torch.isfinite(a).all(), grad_name
        assert rel_err(a, b) < 5e-3, (grad_name, rel_err(a, b))


def test_gluon_selected_kernels_on_packed_documents_match_the_triton_kernels(gluon_packed, monkeypatch):
    # The block-centric Gluon selected forward and backward with PACKED on (blocks start at their document's first
    # token; a document's last block is short) against the Triton kernels: o, o_sel, lse_sel, dK, dV and dQ.
    from nsa.ops.gluon import selected_backward as gluon_selected_backward
    from nsa.ops.gluon import selected_forward as gluon_selected_forward

    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward",
                  "gluon_selected_forward_min_elements", "gluon_selected_backward_min_elements"):
        monkeypatch.setattr(TUNING, field, 0)
    ins, cu, layout = packed_gluon_inputs(seed=13)
    q, k_cmp, k, v, gates = ins[0], ins[1], ins[3], ins[4], ins[7]
    T, scale = q.shape[1], q.shape[-1] ** -0.5
    idx = select_blocks(q, k_cmp, **SELECT_HP, cu_seqlens=cu, backend="triton")
    inverse = build_inverse_index(idx, T, HP["sel_block"], layout)
    o_cmp, o_win = torch.randn_like(q), torch.randn_like(q)
    fwd = gluon_and_triton(monkeypatch, gluon_selected_forward, "gluon_selected_forward", lambda: (
        dispatch.selected_forward(q, k, v, idx, inverse, o_cmp, o_win, gates, scale, GEOMETRY, layout)))
    for out_name, a, b in zip(("o", "o_sel", "lse_sel"), fwd[True], fwd[False]):
        assert torch.isfinite(a).all(), out_name
        assert rel_err(a, b) < 5e-3, (out_name, rel_err(a, b))
    _, o_sel, lse = fwd[False]
    do = torch.randn_like(o_sel)
    delta = (do.float() * o_sel.float()).sum(-1)
    bwd = gluon_and_triton(monkeypatch, gluon_selected_backward, "gluon_selected_backward", lambda: (
        dispatch.selected_backward(q, k, v, idx, inverse, do, lse, delta, scale, GEOMETRY, layout)))
    (dk, dv, sel), (dk_t, dv_t, sel_t) = bwd[True], bwd[False]
    for grad_name, a, b in (("dk", dk, dk_t), ("dv", dv, dv_t), ("dq", sel.dense(), sel_t.dense())):
        assert torch.isfinite(a).all(), grad_name
        assert rel_err(a, b) < 5e-3, (grad_name, rel_err(a, b))


def test_gluon_query_grad_on_packed_documents_matches_the_triton_kernel(gluon_packed, monkeypatch):
    # The Gluon dQ kernel with PACKED on inside a whole packed backward (compressed and window ranges inside each
    # document, the selected branch's block-centric shares), against the Triton dQ kernel.
    from nsa.ops.gluon import query_grad as gluon_query_grad

    ins, cu, _ = packed_gluon_inputs(seed=17)
    calls = []
    original = gluon_query_grad.launch
    monkeypatch.setattr(gluon_query_grad, "launch", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    ins = [t.requires_grad_() for t in ins]
    do = torch.randn(ins[0].shape[:3] + (ins[4].shape[-1],), device="cuda", dtype=torch.bfloat16)
    grads = {}
    for gluon in (True, False):
        monkeypatch.setattr(TUNING, "gluon_query_grad", gluon)
        out = nsa_attention(*ins, **HP, cu_seqlens=cu, backend="triton")
        grads[gluon] = torch.autograd.grad(out, ins[0], do)[0]
    assert calls == [1], "the Gluon dQ kernel did not run (or ran twice)"
    assert torch.isfinite(grads[True]).all()
    assert rel_err(grads[True], grads[False]) < 5e-3, rel_err(grads[True], grads[False])


@pytest.mark.parametrize("B", [1, 16])
def test_decode_prep_kernel_at_m7cs_shape_matches_the_pytorch_step(B):
    # One M7C layer (12 query heads, 2 key/value of 64, three key/value sets, an MLP gate of 64 units) in bf16, each
    # sequence at its own position around 64k in a cache of 65,600 tokens: the decode prep kernel
    # (nsa.ops.triton.decode_prep) against decode._nsa_prep on twin caches, q, gates and the whole raw caches.
    from nsa.inference import new_cache
    from nsa.inference.decode import _nsa_prep, _nsa_prep_triton
    from nsa.model import Transformer, m7c

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(m7c(), n_layers=1, vocab_size=64)).cuda().to(torch.bfloat16).eval()
    caches = [new_cache(model, B, 65600).layers[0] for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(B)
    for name in ("k", "v"):
        start = torch.randn(caches[0].k.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        for cache in caches:
            getattr(cache, name).copy_(start)
    t = 65535 + torch.arange(B, device="cuda") * 4 % 65  # 65,535 .. 65,599
    x = torch.randn(B, 1, 768, device="cuda", generator=gen, dtype=torch.bfloat16)
    cos, sin = model.rope(t[:, None])
    attn = model.layers[0].attn
    with torch.no_grad():
        want_q, want_gates = _nsa_prep(attn, x, cos, sin, caches[0], t)
        got_q, got_gates = _nsa_prep_triton(attn, x, cos, sin, caches[1], t)
    assert torch.equal(caches[1].v, caches[0].v)
    # bf16 keys and queries: one rounding apart where the kernel's float32 products fuse differently.
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-2, atol=1e-2)
    assert torch.equal(caches[1].k[:, :, :65535], caches[0].k[:, :, :65535])  # no earlier slot touched
    torch.testing.assert_close(got_q, want_q, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_gates, want_gates, rtol=1e-2, atol=1e-2)
