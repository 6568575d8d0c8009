"""The model over packed documents (Transformer(tokens, targets, cu_seqlens)): each document is its own sequence,
positions from 0 and no attention across a boundary (docs/design.md#packed-documents), for dense and NSA."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nsa.data.boundaries import padded, row_boundaries
from nsa.model import Transformer, tiny
from torch.nn.attention.flex_attention import flex_attention

from nsa.model.attention import document_attention, masked_document_sdpa
from nsa.model.document_mask import FLEX_BLOCK
from nsa.model.documents import Documents
from nsa.model.compression import BlockCompressor
from nsa.model.config import NSAParams

B, T = 2, 24
DOCUMENTS = [(0, 0, 7), (0, 7, 8), (0, 8, 24), (1, 0, 24)]
"""(row, start, end) of each document: row 0 holds 7, 1 and 16 tokens, row 1 one document of 24."""
CU = padded(torch.tensor([0, 7, 8, 24]), B * T)


def model(attention: str) -> Transformer:
    torch.manual_seed(0)
    # Blocks of 4 tokens and a window of 5: documents longer and shorter than each.
    nsa = NSAParams(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5, phi="mlp", phi_hidden=8,
                    gate_hidden=8)
    m = Transformer(dataclasses.replace(tiny(), attention=attention, vocab_size=64, n_layers=2, nsa=nsa))
    for module in m.modules():  # phi's MLP starts at zero (mean pooling): make it count
        if isinstance(module, BlockCompressor):
            torch.nn.init.normal_(module.fc2.weight, std=0.1)
    return m


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_the_packed_loss_is_the_token_weighted_mean_of_each_document_run_alone(attention):
    m = model(attention)
    x, y = batch()
    packed = m(x, y, CU)
    alone = sum(m(x[r:r + 1, a:b], y[r:r + 1, a:b]) * (b - a) for r, a, b in DOCUMENTS) / (B * T)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    # Across the boundaries the packed sequences differ from the same tokens unmasked.
    assert (m(x, y) - packed).abs() > 1e-3


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_the_compiled_model_gives_the_eager_loss_and_gradients_and_new_boundaries_do_not_recompile_it(attention):
    # The CPU's NSA attends per document in PyTorch, outside the traced graph (its loop reads the boundaries as
    # ints): a compiled block compiles once, whatever the boundaries, and gives the eager numbers.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    m = model(attention)
    compiled = torch.compile(m, backend=counter, dynamic=False)
    torch._dynamo.reset()
    frames = []
    for cut in ([0, 7, 8, 24], [0, 3, 24, 30], [0, 24, 40, 41]):
        x, y = batch(seed=len(frames))
        cu = padded(torch.tensor(cut), B * T)
        want = torch.autograd.grad(m(x, y, cu), list(m.parameters()))
        got = torch.autograd.grad(loss := compiled(x, y, cu), list(m.parameters()))
        torch.testing.assert_close(loss, m(x, y, cu), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1:] == frames[:1] * 2


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_changing_one_document_changes_no_other_documents_logits_or_gradients(attention):
    m = model(attention)
    x, _ = batch()
    changed = x.clone()
    changed[0, 8:24] = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(5))
    before, after = m(x, cu_seqlens=CU), m(changed, cu_seqlens=CU)
    for r, a, b in DOCUMENTS:
        difference = (after[r, a:b] - before[r, a:b]).abs().max()
        assert difference > 1e-3 if (r, a) == (0, 8) else difference < 1e-6, (r, a, b, difference)

    # The loss of the first document reaches no other document's embeddings.
    embedded = []
    hook = m.tok_emb.register_forward_hook(lambda module, args, out: embedded.append(out.retain_grad() or out))
    logits = m(x, cu_seqlens=CU)
    hook.remove()
    F.cross_entropy(logits[0, :7], x[0, 1:8]).backward()
    grad = embedded[0].grad.abs().sum(-1)
    assert grad[0, :7].min() > 0 and grad[0, 7:].max() == 0 and grad[1].max() == 0


def test_every_block_gets_rope_at_document_positions_and_the_documents():
    m = model("dense")
    seen = []
    for layer in m.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args))
    m(batch()[0], cu_seqlens=CU)
    positions = torch.tensor([list(range(7)) + [0] + list(range(16)), list(range(24))])
    cos, sin = m.rope(positions)
    assert cos.shape == (B, T, 1, m.cfg.head_dim // 2)
    for x, layer_cos, layer_sin, documents in seen:
        assert torch.equal(layer_cos, cos) and torch.equal(layer_sin, sin)
        assert torch.equal(documents.positions, positions) and torch.equal(documents.cu_seqlens, CU)
    assert len(seen) == 2


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_one_document_a_row_is_the_unpacked_model(attention):
    m = model(attention)
    x, y = batch()
    torch.testing.assert_close(m(x, cu_seqlens=row_boundaries(x)), m(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(m.hidden(x, row_boundaries(x)), m.hidden(x), atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_and_the_written_out_mask_attend_within_documents():
    torch.manual_seed(0)
    q, k, v = torch.randn(B, 4, T, 8), torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 8)  # grouped: 2 heads a group
    ids = torch.tensor([0] * 7 + [1] + [2] * 16 + [3] * 24).view(B, T)
    expected = torch.zeros(B, 4, T, 8)
    for r, a, b in DOCUMENTS:
        expected[r, :, a:b] = F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b],
                                                             v[r:r + 1, :, a:b], is_causal=True, enable_gqa=True)[0]
    torch.testing.assert_close(masked_document_sdpa(q, k, v, ids), expected, atol=1e-6, rtol=0)
    # FlexAttention runs on the CPU without gradients (it is the GPU's path, where it also trains).
    mask = Documents.from_cu_seqlens(CU, B, T).with_block_mask().block_mask
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask, enable_gqa=True), expected, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("t,lengths", [
    (300, [1, 129, 170, 128, 3, 169]),  # a 1-token document, documents across and inside blocks, a partial block
    (384, [128, 128, 128]),  # documents on block boundaries
    (256, [256, 5, 251, 100, 100, 56]),  # whole rows, a short one at a row's start
    (200, [200]),
])
def test_the_block_mask_lists_every_seen_key_block_and_only_whole_ones_as_full(t, lengths):
    b = sum(lengths) // t
    cu = padded(torch.tensor([0, *lengths]).cumsum(0), b * t)
    documents = Documents.from_cu_seqlens(cu, b, t).with_block_mask()
    mask, ids = documents.block_mask, documents.ids.view(b, t)
    n = -(-t // FLEX_BLOCK)
    seen = (ids[:, :, None] == ids[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()  # [b, t, t]
    for row in range(b):
        for i in range(n):
            rows = slice(i * FLEX_BLOCK, (i + 1) * FLEX_BLOCK)
            partial = mask.kv_indices[row, 0, i, :mask.kv_num_blocks[row, 0, i]].tolist()
            full = mask.full_kv_indices[row, 0, i, :mask.full_kv_num_blocks[row, 0, i]].tolist()
            for j in range(n):
                block = seen[row, rows, j * FLEX_BLOCK:(j + 1) * FLEX_BLOCK]
                assert (j in partial or j in full) == bool(block.any()), (row, i, j)
                assert j not in full or bool(block.all()), (row, i, j)
                assert not (j in partial and j in full)
    torch.manual_seed(0)
    q, k, v = torch.randn(b, 4, t, 8), torch.randn(b, 2, t, 8), torch.randn(b, 2, t, 8)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask, enable_gqa=True),
                               masked_document_sdpa(q, k, v, ids), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernels need a CUDA GPU (run on the GPU machine)")
@pytest.mark.parametrize("compiled", [False, True])
def test_dense_attention_within_documents_trains_through_flex_attention_on_the_gpu(compiled):
    m = model("dense").cuda()
    if compiled:
        for layer in m.layers:
            layer.compile()
    x, y = (t.cuda() for t in batch())
    packed = m(x, y, CU.cuda())
    alone = sum(m(x[r:r + 1, a:b], y[r:r + 1, a:b]) * (b - a) for r, a, b in DOCUMENTS) / (B * T)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    # The gradients FlexAttention's backward gives are the written-out mask's.
    q, k, v = (torch.randn(B, h, T, 16, device="cuda", requires_grad=True) for h in (4, 2, 2))
    documents = Documents.from_cu_seqlens(CU.cuda(), B, T)
    grads = []
    for attend in (lambda *qkv: document_attention(*qkv, documents), lambda *qkv: masked_document_sdpa(*qkv, documents.ids.view(B, T))):
        out = attend(q, k, v)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for flex, written_out in zip(*grads):
        torch.testing.assert_close(flex, written_out, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernels need a CUDA GPU (run on the GPU machine)")
@pytest.mark.parametrize("compiled", [False, True])
def test_dense_attention_within_documents_trains_and_validates_at_a_real_shape_in_bf16(compiled):
    """8 query / 2 key-value heads of 64, 16 rows of 2,048 tokens of documents from 1 token to a whole row, in bf16:
    a training step, then validation without gradients (whose FlexAttention kernel differs from training's), eager
    and with every block compiled; the validation loss is the written-out mask's."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny(), attention="dense", vocab_size=256, dim=512, n_layers=2, n_heads=8,
                              n_kv_heads=2, head_dim=64, mlp_hidden=1024)
    m = Transformer(cfg).cuda()
    if compiled:
        for layer in m.layers:
            layer.compile()
    rows, t = 16, 2048
    lengths = torch.randint(1, 700, (200,)).tolist()
    cu = padded(torch.tensor([0, *lengths]).cumsum(0).clamp(max=rows * t), rows * t)
    cu = torch.unique(torch.cat([cu, torch.arange(0, rows * t + 1, t)])).to(torch.int32)  # rows never share one
    cu = padded(cu, rows * t).cuda()
    x, y = (torch.randint(0, 256, (rows, t), device="cuda") for _ in range(2))
    with torch.autocast("cuda", torch.bfloat16):
        m(x, y, cu).backward()
        with torch.no_grad():
            flex = m(x, y, cu).float().item()
    reference = Transformer(cfg)  # the same weights on the CPU, where attention writes the mask out in full
    reference.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    with torch.no_grad():
        written_out = reference(x.cpu(), y.cpu(), cu.cpu()).item()
    assert flex == pytest.approx(written_out, rel=1e-2)
