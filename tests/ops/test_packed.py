"""Packed documents (cu_seqlens): each document is its own sequence, in outputs, selected blocks and every
gradient (docs/design.md#packed-documents). The packed op is checked against the literal loop transcription run
on each document alone, and against the unpacked op on each document."""

import pytest
import torch

from literal_nsa import literal_nsa
from nsa.model.compression import BlockCompressor
from nsa.ops import NSAGeometry, compressed_offsets, nsa_attention, select_blocks

F64 = torch.float64
# Document lengths: 1 token, shorter than a compression block, shorter than a selection block, not a multiple
# of any block size, an empty document (padding) in the middle and at the end, and lengths that repeat (the
# reference runs documents of one length as one batch).
LENGTHS = [1, 3, 0, 13, 8, 13, 21, 5, 1, 0]
BACKENDS = ["reference", "triton"]


def precision(backend):
    """Inputs' dtype and the comparison's tolerances: float64 for the reference, float32 for the kernels (run
    by Triton's interpreter on the CPU)."""
    return (F64, {}) if backend == "reference" else (torch.float32, dict(rtol=1e-4, atol=1e-5))


def packed_inputs(lengths, H, G, D, geometry, seed=0, dtype=F64):
    """q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates of one packed stream (k_cmp/v_cmp with Nc(total) rows,
    those past the documents' compressed tokens random too: they must be ignored), and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    rows = geometry.num_compressed_blocks(total)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_()

    tensors = [rnd(1, total, H, D), rnd(1, rows, G, D), rnd(1, rows, G, D), rnd(1, total, G, D), rnd(1, total, G, D),
               rnd(1, total, G, D), rnd(1, total, G, D),
               torch.rand(1, total, H, 3, generator=g, dtype=F64).to(dtype).requires_grad_()]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tensors, cu


def documents(tensors, cu, geometry):
    """Each document's own inputs: raw tensors cut at its tokens, compressed ones at its rows."""
    bounds, offsets = cu.tolist(), compressed_offsets(cu, geometry).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            q, k_cmp, v_cmp, *raw = tensors
            yield (a, b), [q[:, a:b], k_cmp[:, offsets[i]:offsets[i + 1]], v_cmp[:, offsets[i]:offsets[i + 1]],
                           *(t[:, a:b] for t in raw)]


# Group sizes 1, 6 and 16 on the reference; the kernels' stages are checked at each in test_triton_packed_*.py.
@pytest.mark.parametrize("backend,H,G", [("reference", 2, 2), ("reference", 6, 1), ("reference", 16, 1),
                                         ("triton", 6, 1)])
def test_packed_attention_equals_each_document_alone(backend, H, G):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    dtype, tol = precision(backend)
    tensors, cu = packed_inputs(LENGTHS, H, G, 4, geometry, dtype=dtype)
    out = nsa_attention(*tensors, geometry=geometry, cu_seqlens=cu, backend=backend)
    idx = select_blocks(tensors[0], tensors[1], geometry=geometry, cu_seqlens=cu, backend=backend)
    assert out.shape == (1, sum(LENGTHS), H, 4) and idx.shape == (1, sum(LENGTHS), G, 3)
    hyper = dict(block_len=4, block_stride=2, sel_block=4, n_sel=3)
    for (a, b), doc in documents([t.detach() for t in tensors], cu, geometry):
        want, want_idx = literal_nsa(*(t.double() for t in doc), **hyper, window=5)
        torch.testing.assert_close(out[:, a:b].detach(), want.to(dtype), **tol)
        torch.testing.assert_close(idx[:, a:b], want_idx)

    # Every gradient equals the one each document gets alone, and the unused compressed rows get none.
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    offsets = compressed_offsets(cu, geometry).tolist()
    for (a, b), doc in documents(tensors, cu, geometry):
        alone = nsa_attention(*doc, geometry=geometry, backend="reference")
        want = torch.autograd.grad((alone * weights[:, a:b]).sum(), doc, allow_unused=True)
        got_raw = [grads[i][:, a:b] for i in (0, 3, 4, 5, 6, 7)]
        for got, exp in zip(got_raw, [want[i] for i in (0, 3, 4, 5, 6, 7)]):
            torch.testing.assert_close(got, exp, **tol)
    for got, exp_rows in zip(grads[1:3], [1, 2]):
        pieces = [torch.autograd.grad((nsa_attention(*doc, geometry=geometry, backend="reference")
                                       * weights[:, a:b]).sum(), doc[exp_rows])[0]
                  for (a, b), doc in documents(tensors, cu, geometry)]
        torch.testing.assert_close(got[:, :offsets[-1]], torch.cat(pieces, dim=1), **tol)
        assert got[:, offsets[-1]:].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_packed_document_is_the_unpacked_call(backend):
    geometry = NSAGeometry(block_len=8, block_stride=4, sel_block=8, n_sel=4, window=9)
    dtype, tol = precision(backend)
    # A trailing empty document (padding) keeps the packed path: two boundaries alone take the unpacked one.
    tensors, cu = packed_inputs([45, 0], 6, 2, 8, geometry, seed=3, dtype=dtype)
    packed = nsa_attention(*tensors, geometry=geometry, cu_seqlens=cu, backend=backend)
    torch.testing.assert_close(packed, nsa_attention(*tensors, geometry=geometry, backend=backend), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_one_document_changes_no_other(backend):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=6)
    lengths = [17, 9, 22]
    tensors, cu = packed_inputs(lengths, 4, 2, 4, geometry, seed=5, dtype=precision(backend)[0])
    tensors = [t.detach() for t in tensors]
    out = nsa_attention(*tensors, geometry=geometry, cu_seqlens=cu, backend=backend)
    idx = select_blocks(tensors[0], tensors[1], geometry=geometry, cu_seqlens=cu, backend=backend)
    # Perturb every input of the middle document: its tokens and its compressed rows.
    a, b = 17, 26
    offsets = compressed_offsets(cu, geometry).tolist()
    changed = [t.clone() for t in tensors]
    for i in (0, 3, 4, 5, 6, 7):
        changed[i][:, a:b] += 1.0
    for i in (1, 2):
        changed[i][:, offsets[1]:offsets[2]] *= -3.0
    out2 = nsa_attention(*changed, geometry=geometry, cu_seqlens=cu, backend=backend)
    idx2 = select_blocks(changed[0], changed[1], geometry=geometry, cu_seqlens=cu, backend=backend)
    others = torch.cat([torch.arange(0, a), torch.arange(b, sum(lengths))])
    torch.testing.assert_close(out2[:, others], out[:, others], rtol=0, atol=0)
    assert torch.equal(idx2[:, others], idx[:, others])
    assert (out2[:, a:b] - out[:, a:b]).abs().max() > 0.1


def test_compressed_offsets_count_each_documents_blocks():
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    cu = torch.tensor([0, 1, 6, 6, 17, 20], dtype=torch.int32)  # lengths 1, 5, 0, 11, 3
    assert compressed_offsets(cu, geometry).tolist() == [0, 0, 1, 1, 5, 5]


@pytest.mark.parametrize("kind", ["mean", "mlp"])
def test_packed_compression_equals_each_document_compressed_alone(kind):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    phi = BlockCompressor(8, 4, 2, kind, hidden=16).double()
    if kind == "mlp":
        torch.nn.init.normal_(phi.fc2.weight)  # the zero-initialised last layer would hide the MLP
    total = sum(LENGTHS)
    x = torch.randn(1, total, 2, 8, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = phi(x, cu)
    assert packed.shape == (1, geometry.num_compressed_blocks(total), 2, 8)
    bounds, offsets = cu.tolist(), compressed_offsets(cu, geometry).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            torch.testing.assert_close(packed[:, offsets[i]:offsets[i + 1]], phi(x[:, a:b]))
    assert packed[:, offsets[-1]:].abs().max() == 0
    # The gradient of a document's compressed tokens reaches only that document's tokens.
    (grad,) = torch.autograd.grad(packed[:, offsets[3]:offsets[4]].sum(), x)
    inside = torch.zeros(total, dtype=torch.bool)
    inside[bounds[3]:bounds[4]] = True
    assert grad[0, ~inside].abs().max() == 0 and grad[0, inside].abs().max() > 0


@pytest.mark.parametrize("cu,message", [
    (torch.tensor([0, 5, 9], dtype=torch.int64), "int32"),
    (torch.tensor([0, 5, 8], dtype=torch.int32), "end at the 9 packed tokens"),
    (torch.tensor([0, 6, 5, 9], dtype=torch.int32), "never decrease"),
])
def test_bad_boundaries_are_named(cu, message):
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    tensors, _ = packed_inputs([9], 2, 1, 4, geometry)
    with pytest.raises(ValueError, match=message):
        nsa_attention(*tensors, geometry=geometry, cu_seqlens=cu, backend="reference")


def test_packed_inputs_must_be_one_stream():
    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    tensors, cu = packed_inputs([9], 2, 1, 4, geometry)
    doubled = [torch.cat([t, t]) for t in tensors]
    with pytest.raises(ValueError, match=r"one packed sequence \[1, total, H, Dk\]"):
        nsa_attention(*doubled, geometry=geometry, cu_seqlens=cu)


def test_the_packed_layout_tables_locate_every_document():
    from nsa.ops.packing import packed_layout, selection_block_capacity

    geometry = NSAGeometry(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5)
    lengths = [1, 5, 0, 11, 3, 0]
    cu = torch.tensor([0, 1, 6, 6, 17, 20, 20], dtype=torch.int32)
    total, rows = 20, geometry.num_compressed_blocks(20)
    layout = packed_layout(cu, geometry, total, rows)
    starts = [0] + [1] * 5 + [6] * 11 + [17] * 3
    assert layout.doc_start.tolist() == starts
    assert layout.doc_end.tolist() == [1] + [6] * 5 + [17] * 11 + [20] * 3
    # Compressed rows: document 1 (5 tokens) has one block (tokens 1-4), document 3 (11 tokens) four (6-9,
    # 8-11, 10-13, 12-15); the other rows hold none.
    assert layout.cmp_start.tolist() == [0] + [0] * 5 + [1] * 11 + [5] * 3
    assert layout.cmp_ready.tolist() == [4, 9, 11, 13, 15] + [20] * (rows - 5)
    assert layout.cmp_doc_end.tolist() == [6, 17, 17, 17, 17] + [20] * (rows - 5)
    # Selection blocks of 4: document 0 one (0), document 1 two (1-4, 5), document 3 three (6-9, 10-13, 14-16),
    # document 4 one (17-19).
    assert layout.sel_start.tolist() == [0] + [1] * 5 + [3] * 11 + [6] * 3
    capacity = selection_block_capacity(total, len(lengths) + 1, 4)
    assert layout.num_blocks == capacity
    used = 7
    assert layout.block_start.tolist()[:used] == [0, 1, 5, 6, 10, 14, 17]
    assert layout.block_end.tolist()[:used] == [1, 5, 6, 10, 14, 17, 20]
    assert layout.block_start.tolist()[used:] == layout.block_end.tolist()[used:]
