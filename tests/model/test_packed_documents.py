"""The model over packed documents (Transformer(tokens, targets, cu_seqlens)): each document is its own sequence,
positions from 0 and no attention across a boundary (docs/design.md#packed-documents), for dense and NSA."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nsa.data.boundaries import padded, row_boundaries
from nsa.model import Transformer, tiny
from nsa.model.attention import document_attention, flex_document_attention, masked_document_sdpa
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
    torch.testing.assert_close(flex_document_attention(q, k, v, ids), expected, atol=1e-6, rtol=0)


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
    ids = torch.tensor([0] * 7 + [1] + [2] * 16 + [3] * 24, device="cuda").view(B, T)
    grads = []
    for attend in (document_attention, masked_document_sdpa):
        out = attend(q, k, v, ids)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for flex, written_out in zip(*grads):
        torch.testing.assert_close(flex, written_out, atol=1e-4, rtol=1e-4)
