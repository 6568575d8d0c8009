"""Selection distillation: its KL against a per-query transcription, its gradient, what it teaches, its config."""

import dataclasses

import pytest
import torch

from nsa.errors import ConfigError
from nsa.model import tiny
from nsa.model.attention import NSAAttention
from nsa.model.compression import BlockCompressor
from nsa.model.documents import Documents
from nsa.model.rope import RotaryEmbedding
from nsa.model.selection_distill import packed_selection_distillation, selection_distillation, with_auxiliary_loss
from nsa.ops import NSAGeometry, reference

GEOMETRY = NSAGeometry(block_len=16, block_stride=8, sel_block=16, n_sel=4, window=16)


def _loop_terms(q, k_cmp, k_sel, geometry, queries):
    """The KL terms transcribed one (row, query, group) at a time; the student from the reference's selection
    scores."""
    b, t, h, d = q.shape
    groups = k_sel.shape[2]
    per_group = h // groups
    student_all = reference.selection_scores(q, k_cmp, block_len=geometry.block_len,
                                             block_stride=geometry.block_stride, sel_block=geometry.sel_block)
    terms = []
    for row in range(b):
        for pos in range(max(0, t - queries), t):
            own = pos // geometry.sel_block
            candidates = list(range(1, own - 1))
            if len(candidates) < 2:
                continue
            for g in range(groups):
                teacher = torch.zeros(len(candidates), dtype=torch.float64)
                for head in range(g * per_group, (g + 1) * per_group):
                    weights = torch.softmax(k_sel[row, : pos + 1, g].double() @ q[row, pos, head].double() / d**0.5, 0)
                    for i, j in enumerate(candidates):
                        teacher[i] += weights[j * geometry.sel_block:(j + 1) * geometry.sel_block].sum() / per_group
                student = student_all[row, pos, g, candidates].double()
                teacher, student = teacher / teacher.sum(), student / student.sum()
                terms.append((teacher * (teacher.log() - student.log())).sum())
    return terms


@pytest.mark.parametrize("t, queries", [(100, 20), (77, 200), (96, 5)])
def test_the_kl_matches_a_per_query_transcription(t, queries):
    torch.manual_seed(t)
    b, h, g, d = 2, 6, 2, 8
    q, k_sel = torch.randn(b, t, h, d), torch.randn(b, t, g, d)
    k_cmp = BlockCompressor(d, GEOMETRY.block_len, GEOMETRY.block_stride, "mean")(torch.randn(b, t, g, d))
    got = selection_distillation(q, k_cmp, k_sel, GEOMETRY, queries)
    want = torch.stack(_loop_terms(q, k_cmp, k_sel, GEOMETRY, queries)).mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_packed_documents_average_every_documents_terms():
    torch.manual_seed(1)
    lengths, h, g, d = [100, 100, 70, 0, 70, 100, 20], 4, 2, 8
    compress = BlockCompressor(d, GEOMETRY.block_len, GEOMETRY.block_stride, "mean")
    docs = [(torch.randn(1, n, h, d), torch.randn(1, n, g, d), torch.randn(1, n, g, d)) for n in lengths]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k_raw, k_sel = (torch.cat([doc[i] for doc in docs], dim=1) for i in range(3))
    k_cmp = compress(k_raw, cu_seqlens)
    got = packed_selection_distillation(q, k_cmp, k_sel, GEOMETRY, 30, cu_seqlens)
    terms = [term for qd, kd, sd in docs if qd.shape[1] for term in _loop_terms(qd, compress(kd), sd, GEOMETRY, 30)]
    torch.testing.assert_close(got.double(), torch.stack(terms).mean(), rtol=1e-4, atol=1e-6)


def test_fewer_than_two_candidates_give_zero_without_gradient():
    q = torch.randn(1, 64, 2, 8, requires_grad=True)  # blocks 0-3: one candidate (1) at most, never two
    k_cmp = torch.randn(1, 7, 1, 8)
    got = selection_distillation(q, k_cmp, torch.randn(1, 64, 1, 8), GEOMETRY, 16)
    assert got.item() == 0 and not got.requires_grad


def _layer(weight: float) -> NSAAttention:
    cfg = dataclasses.replace(tiny(), dim=32, n_heads=4, n_kv_heads=2, head_dim=8)
    cfg.nsa = dataclasses.replace(cfg.nsa, block_len=16, block_stride=8, sel_block=16, n_sel=4, window=16,
                                  phi="mean", selection_distill=weight, selection_distill_queries=24)
    torch.manual_seed(0)
    return NSAAttention(cfg).train()


@pytest.mark.parametrize("packed", [False, True])
def test_the_layer_adds_the_weighted_kl_to_the_gradient_and_nothing_to_the_output(packed):
    x = torch.randn(2, 90, 32)
    documents = Documents.from_cu_seqlens(torch.tensor([0, 50, 90, 180]), 2, 90) if packed else None
    positions = documents.positions if packed else torch.arange(90)
    cos, sin = RotaryEmbedding(8)(positions)
    with_term, without = _layer(0.5), _layer(0.0)
    out = with_term(x, cos, sin, documents)
    torch.testing.assert_close(out, without(x, cos, sin, documents), rtol=0, atol=0)
    out.square().sum().backward()
    p = {name: value.flatten(0, 1).unsqueeze(0) if packed else value
         for name, value in without.project(x, cos, sin).items()}
    if packed:
        k_cmp = without.compress_k(p["k_cmp"], documents.cu_seqlens)
        kl = packed_selection_distillation(p["q"], k_cmp, p["k_sel"], without.geometry, 24, documents.cu_seqlens)
    else:
        kl = selection_distillation(p["q"], without.compress_k(p["k_cmp"]), p["k_sel"], without.geometry, 24)
    (without(x, cos, sin, documents).square().sum() + 0.5 * kl).backward()
    assert kl.item() > 0
    for (name, a), b in zip(with_term.named_parameters(), without.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    changed = _layer(0.0)
    changed(x, cos, sin, documents).square().sum().backward()
    assert not torch.allclose(changed.wkv.weight.grad, with_term.wkv.weight.grad)  # the term reaches the keys


def test_evaluation_and_no_grad_forwards_skip_the_term():
    layer = _layer(1.0).eval()
    x = torch.randn(1, 64, 32, requires_grad=True)
    cos, sin = RotaryEmbedding(8)(torch.arange(64))
    layer(x, cos, sin).sum().backward()
    reference_layer = _layer(0.0).eval()
    x2 = x.detach().clone().requires_grad_()
    reference_layer(x2, cos, sin).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_the_term_teaches_the_scores_to_select_the_block_the_selected_keys_point_at():
    """A needle block whose selected-branch keys match the last queries: trained on the term alone, the compressed
    keys come to rank it in the top-n, where they did not at the start."""
    torch.manual_seed(3)
    t, d, needle = 256, 16, 5
    q, direction = torch.randn(1, t, 2, d), torch.randn(d)
    q[0, -8:] = direction  # the last queries (both heads) ask for it
    k_sel = torch.randn(1, t, 1, d) * 0.3
    k_sel[0, needle * 16:(needle + 1) * 16, 0] += direction
    raw = torch.nn.Parameter(torch.randn(1, t, 1, d))
    compress = BlockCompressor(d, GEOMETRY.block_len, GEOMETRY.block_stride, "mean")
    geometry = dataclasses.replace(GEOMETRY, n_sel=4)

    def chosen():
        with torch.no_grad():
            return reference.select_blocks(q, compress(raw), geometry=geometry)[0, -1, 0].tolist()

    assert needle not in chosen()
    opt = torch.optim.Adam([raw], lr=0.05)
    first = None
    for _ in range(150):
        loss = selection_distillation(q, compress(raw), k_sel, geometry, 8)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    assert needle in chosen()


def test_with_auxiliary_loss_passes_output_and_gradient_through():
    out, w = torch.randn(3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    y = with_auxiliary_loss(out * 1, w * w)
    torch.testing.assert_close(y, out)
    y.sum().backward()
    torch.testing.assert_close(out.grad, torch.ones(3))
    torch.testing.assert_close(w.grad, torch.tensor(4.0))


def test_the_settings_are_checked():
    cfg = tiny()
    cfg.nsa.selection_distill = -1.0
    with pytest.raises(ConfigError, match="selection_distill must be >= 0"):
        cfg.validate()
    cfg.nsa.selection_distill, cfg.nsa.selection_distill_queries = 0.1, 0
    with pytest.raises(ConfigError, match="selection_distill_queries must be >= 1"):
        cfg.validate()
