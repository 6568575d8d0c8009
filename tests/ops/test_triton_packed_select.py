"""Packed documents in the selection and selected-branch kernels: one launch over a packed stream equals the
reference run on each document alone (selected blocks, the branch's output and every gradient).

Without a GPU these run in Triton's CPU interpreter (tests/conftest.py): tiny shapes, few programs, float32.
"""

import pytest
import torch

from helpers import assert_same_selection
from nsa.ops import NSAGeometry, compressed_offsets, dispatch, reference, tuning
from nsa.ops.packing import packed_layout
from nsa.ops.triton.inverse_index import build_inverse_index
from nsa.ops.triton.selection import select_blocks_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-5)
# 1 token, shorter than a compression block, shorter than a selection block, not a multiple of any block size,
# several documents in one tile of queries, empty documents (padding) in the middle and at the end.
SELECTED_LENGTHS = [1, 5, 0, 19, 16, 25, 3, 0]
# ... and a document long enough for two chunks of 16 selection blocks, the later tiles seeing the first whole.
SELECTION_LENGTHS = [1, 3, 0, 13, 90, 8, 21, 5, 0]


def stream(lengths, H, G, D, geometry, seed=0):
    """q [1,total,H,D], k_cmp [1,Nc(total),G,D] (rows past the documents' compressed tokens random: they must be
    ignored), k, v [1,total,G,D] and cu_seqlens (int32) of one packed stream."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, total, H, D, generator=g)
    k_cmp = torch.randn(1, geometry.num_compressed_blocks(total), G, D, generator=g)
    k, v = torch.randn(2, 1, total, G, D, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cmp, k, v, cu


def documents(cu, geometry):
    """((first token, end), (first compressed row, end)) of each non-empty document."""
    bounds, offsets = cu.tolist(), compressed_offsets(cu, geometry).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            yield (a, b), (offsets[i], offsets[i + 1])


def compressed_lse(q, k_cmp, cu, geometry, scale):
    """The compressed branch's log-sum-exp [1,total,H] of each document alone (-inf where nothing is visible)."""
    lse = torch.full(q.shape[:3], float("-inf"))
    h = q.shape[2] // k_cmp.shape[2]
    for (a, b), (r0, r1) in documents(cu, geometry):
        s = torch.einsum("thd,nhd->thn", q[0, a:b], k_cmp[0, r0:r1].repeat_interleave(h, 1)) * scale
        ends = torch.arange(r1 - r0) * geometry.block_stride + geometry.block_len - 1
        visible = ends[None, None, :] <= torch.arange(b - a)[:, None, None]
        lse[0, a:b] = torch.logsumexp(s.masked_fill(~visible, float("-inf")), -1)
    return lse


# (l, d, l', n, H, G, transposed scores): the two-weight stencil (l <= l', l'/d a power of two) with a group of 6
# in two head sets transposed and one padded set untransposed; general overlaps (l > l') at group sizes 1 and 16;
# selection blocks wider than a compressed block with free slots.
SELECTION_CASES = [(4, 2, 4, 3, 6, 1, True), (4, 2, 4, 3, 6, 1, False), (8, 4, 4, 3, 2, 2, True),
                   (8, 4, 4, 3, 16, 1, False), (4, 2, 8, 4, 6, 1, True)]


@pytest.mark.parametrize("l,d,lp,n,H,G,transposed", SELECTION_CASES)
def test_packed_selection_equals_each_document_alone(l, d, lp, n, H, G, transposed, monkeypatch):
    monkeypatch.setattr(tuning.TUNING, "select_transposed_max_rows", 10**9 if transposed else 0)
    geometry = NSAGeometry(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=1)
    q, k_cmp, _, _, cu = stream(SELECTION_LENGTHS, H, G, 8, geometry, seed=H)
    scale = 8**-0.5
    lse = compressed_lse(q, k_cmp, cu, geometry, scale)
    layout = packed_layout(cu, geometry, q.shape[1], k_cmp.shape[1])
    idx = select_blocks_fwd(q.to(DEVICE), k_cmp.to(DEVICE), lse.to(DEVICE), scale, geometry,
                            layout=packed_layout(cu.to(DEVICE), geometry, q.shape[1], k_cmp.shape[1])).cpu()
    assert layout.num_blocks > 0 and idx.shape == (1, q.shape[1], G, n)
    for (a, b), (r0, r1) in documents(cu, geometry):
        scores = reference.selection_scores(q[:, a:b], k_cmp[:, r0:r1], block_len=l, block_stride=d, sel_block=lp,
                                            scale=scale)
        want = reference.top_n_blocks(scores, sel_block=lp, n_sel=n)
        assert_same_selection(idx[:, a:b], want, scores, rtol=1e-5 if DEVICE == "cpu" else 1e-2)


def test_one_packed_document_selects_as_the_unpacked_call():
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=1)
    q, k_cmp, _, _, cu = stream([70], 4, 1, 8, geometry, seed=1)
    lse = compressed_lse(q, k_cmp, cu, geometry, 0.3)
    q, k_cmp, lse, cu = (x.to(DEVICE) for x in (q, k_cmp, lse, cu))
    packed = select_blocks_fwd(q, k_cmp, lse, 0.3, geometry, layout=packed_layout(cu, geometry, 70, k_cmp.shape[1]))
    assert torch.equal(packed, select_blocks_fwd(q, k_cmp, lse, 0.3, geometry))


@pytest.fixture(params=["token", "blocks"])
def gathered_path(request, monkeypatch):
    """The selected branch per query (its dK/dV block-centric) or block-centric throughout, never tiled; work
    items of at most 4 queries, so that a block chosen by many queries spans several."""
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
        monkeypatch.setattr(tuning.TUNING, field, 0)
    monkeypatch.setattr(tuning.TUNING, "token_min_heads", 1 if request.param == "token" else 10**9)
    monkeypatch.setattr(tuning.TUNING, "inverse_chunk", 4)
    return request.param


def selected_branch(q, k, v, idx, cu, geometry, scale, do):
    """(o_sel, dq, dk, dv) of the packed selected branch through dispatch, gates at 1 (o = o_sel)."""
    layout = packed_layout(cu, geometry, q.shape[1], 0)
    inverse = build_inverse_index(idx, q.shape[1], geometry.sel_block, layout)
    zeros, gates = torch.zeros_like(q), torch.ones(*q.shape[:3], 3, device=q.device)
    o, o_sel, lse = dispatch.selected_forward(q, k, v, idx, inverse, zeros, zeros, gates, scale, geometry, layout)
    assert torch.equal(o, o_sel)
    dk, dv, sel = dispatch.selected_backward(q, k, v, idx, inverse, do, lse, (do * o_sel).sum(-1), scale, geometry,
                                             layout)
    return o_sel, sel.dense(), dk, dv


# (l', H, G, deterministic sums): a block narrower than the kernels' key tile (l' = 8 of 16) and one filling it
# (whose queries past the block see it whole, unmasked), group sizes 1, 6 and 16.
SELECTED_CASES = [(8, 2, 2, False), (8, 6, 1, False), (16, 6, 1, False), (16, 16, 1, False), (16, 6, 1, True)]


@pytest.mark.parametrize("lp,H,G,deterministic", SELECTED_CASES)
def test_packed_selected_branch_equals_each_document_alone(lp, H, G, deterministic, gathered_path):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=lp, n_sel=3, window=1)
    q, k_cmp, k, v, cu = stream(SELECTED_LENGTHS, H, G, 8, geometry, seed=lp + H)
    idx = reference.select_blocks(q, k_cmp, geometry=geometry, cu_seqlens=cu)
    assert (idx < 0).any() and (idx > 0).any()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    scale = 8**-0.5
    # Deterministic mode: each work item's dK/dV partial in a slot of its own, summed per block in item order.
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = selected_branch(*(x.to(DEVICE) for x in (q, k, v, idx, cu)), geometry, scale, do.to(DEVICE))
    finally:
        torch.use_deterministic_algorithms(False)
    o, dq, dk, dv = (x.cpu() for x in got)
    for (a, b), _ in documents(cu, geometry):
        ins = [x[:, a:b].clone().requires_grad_() for x in (q, k, v)]
        want = reference.selected_attention(*ins, idx[:, a:b], sel_block=lp, scale=scale)
        torch.testing.assert_close(o[:, a:b], want, **TOL)
        grads = torch.autograd.grad(want, ins, do[:, a:b])
        for name, got, g in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            torch.testing.assert_close(got[:, a:b], g, **TOL, msg=lambda m: f"{name} of tokens {a}..{b}: {m}")
