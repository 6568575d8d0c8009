"""The span kernels (compressed, window and tiled selected branches: forward and dK/dV) and the dQ kernel on packed
documents (a PackedLayout), against the reference's branch functions run on each document alone; and the kernels'
whole packed call (nsa::forward / nsa::backward) against the packed reference.

CPU interpreter (tests/conftest.py): tiny shapes, float32. The documents are of 1 token, shorter than a block, not
a multiple of any block size, empty (padding, also at the end), and one long enough that key steps and row steps
lie wholly inside it (the kernels skip masking those).
"""

import pytest
import torch

from helpers import packed_branch_kernels, packed_branch_reference
from nsa.ops import NSAGeometry, compressed_offsets, dispatch, nsa_attention, reference, tuning
from nsa.ops.branches import MODE_CMP, MODE_SEL, MODE_WIN
from nsa.ops.dispatch import span_forward
from nsa.ops.packing import packed_layout

LENGTHS = [1, 3, 0, 13, 40, 5, 0]
TOL = dict(rtol=1e-4, atol=1e-5)
SCALE = 0.4


def stream(lengths, H, G, D, geometry, seed):
    """q, k_cmp, v_cmp, k, v of one packed stream (k_cmp/v_cmp with Nc(total) rows, the unused ones random too),
    cu_seqlens, and each document's compressed rows."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    rows = geometry.num_compressed_blocks(total)
    q = torch.randn(1, total, H, D, generator=g)
    k_cmp, v_cmp = (torch.randn(1, rows, G, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, total, G, D, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cmp, v_cmp, k, v, cu, compressed_offsets(cu, geometry).tolist()


def document_choices(lengths, G, geometry, seed):
    """Random document-relative choices [1, total, G, n]: up to n distinct blocks among those a token may pick
    (j * l' <= t), ascending, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        for t in range(length):
            for _ in range(G):
                blocks = torch.randperm(t // geometry.sel_block + 1, generator=g)[:geometry.n_sel].sort().values
                rows.append(torch.cat([blocks, blocks.new_full((geometry.n_sel - blocks.numel(),), -1)]))
    return torch.stack(rows).view(1, sum(lengths), G, geometry.n_sel)


# (H, G, geometry): group sizes 1, 6 and 16; a window that holds whole key steps and one that never does; d = 1,
# whose compressed rows hold whole key steps of the long document.
CASES = [
    (2, 2, NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=19)),
    (2, 1, NSAGeometry(block_len=4, block_stride=1, sel_block=8, n_sel=3, window=5)),
    (6, 1, NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=17)),
    (16, 1, NSAGeometry(block_len=4, block_stride=2, sel_block=8, n_sel=3, window=5)),
]


@pytest.mark.parametrize("mode", [MODE_CMP, MODE_WIN, MODE_SEL], ids=["cmp", "win", "sel"])
@pytest.mark.parametrize("H,G,geometry", CASES, ids=[f"h{h // g}-d{geo.block_stride}-w{geo.window}"
                                                    for h, g, geo in CASES])
def test_packed_span_stages_equal_each_document_alone(mode, H, G, geometry):
    q, k_cmp, v_cmp, k, v, cu, offsets = stream(LENGTHS, H, G, 8, geometry, seed=H + geometry.window)
    if mode == MODE_CMP:
        k, v = k_cmp, v_cmp
    indices = document_choices(LENGTHS, G, geometry, seed=1) if mode == MODE_SEL else None
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    layout = packed_layout(cu, geometry, q.shape[1], k_cmp.shape[1])

    out, grads = packed_branch_kernels(mode, geometry, SCALE, q, k, v, indices, do, layout)
    want, want_grads = packed_branch_reference(mode, geometry, SCALE, q, k, v, indices, do, cu)
    torch.testing.assert_close(out, want, **TOL)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, want_grads):
        torch.testing.assert_close(got, exp, **TOL, msg=lambda m: f"{name}: {m}")
    if mode == MODE_CMP:  # rows past the documents' compressed tokens: no query sees them
        assert offsets[-1] < k.shape[1] and grads[1][:, offsets[-1]:].abs().max() == 0


def test_packed_compressed_lse_is_minus_infinity_before_a_document_completes_a_block():
    geometry = CASES[0][2]
    q, k_cmp, v_cmp, _, _, cu, _ = stream(LENGTHS, 2, 2, 8, geometry, seed=0)
    o, lse = span_forward(q, k_cmp, v_cmp, MODE_CMP, SCALE, geometry,
                          layout=packed_layout(cu, geometry, q.shape[1], k_cmp.shape[1]))
    starts = cu.tolist()
    position = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:])])
    blind = position < geometry.block_len - 1
    assert torch.isinf(lse[0, blind]).all() and (o[0, blind] == 0).all()
    assert torch.isfinite(lse[0, ~blind]).all()


@pytest.fixture
def reference_selection(monkeypatch):
    """The kernels' whole packed call, tiled selected branch, with the reference's per-document selection in place
    of the selection kernel (covered by its own tests): the span and dQ kernels and their plumbing alone."""
    for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
        monkeypatch.setattr(tuning.TUNING, field, 10**9)

    def select(q, k_cmp, lse_cmp, scale, geometry, layout=None):
        cu = torch.unique_consecutive(torch.cat([layout.doc_start, layout.doc_end.new_tensor([q.shape[1]])]))
        return reference.select_blocks(q, k_cmp, geometry=geometry, scale=scale, cu_seqlens=cu.to(torch.int32))

    monkeypatch.setattr(dispatch, "select_blocks", select)


@pytest.mark.parametrize("H,G", [(2, 2), (6, 1)])
def test_packed_kernel_call_equals_the_packed_reference(reference_selection, H, G):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=6)
    q, k_cmp, v_cmp, k, v, cu, offsets = stream(LENGTHS, H, G, 8, geometry, seed=5)
    g = torch.Generator().manual_seed(6)
    k_win, v_win = (torch.randn(k.shape, generator=g) for _ in range(2))
    gates = torch.rand(1, q.shape[1], H, 3, generator=g)
    ins = [t.requires_grad_() for t in (q, k_cmp, v_cmp, k, v, k_win, v_win, gates)]
    out = nsa_attention(*ins, geometry=geometry, scale=SCALE, cu_seqlens=cu, backend="triton")
    want = nsa_attention(*ins, geometry=geometry, scale=SCALE, cu_seqlens=cu, backend="reference")
    torch.testing.assert_close(out, want, **TOL)
    do = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, ins, do)
    for name, got, exp in zip(("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates"), grads,
                              torch.autograd.grad(want, ins, do)):
        torch.testing.assert_close(got, exp, **TOL, msg=lambda m: f"d{name}: {m}")
