"""The reference against the NSA contract (docs/design.md): dense equivalences and a literal loop implementation."""

import pytest
import torch

from helpers import naive_masked_attention, nsa_inputs
from literal_nsa import literal_nsa, literal_selection
from nsa.ops import nsa_attention, reference, select_blocks

F64 = torch.float64


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


@pytest.mark.parametrize("T,H,G", [(37, 6, 2), (64, 4, 4), (5, 3, 1)])
def test_window_covering_everything_is_dense_causal(T, H, G):
    q, _, _, _, _, k, v, _ = nsa_inputs(2, T, H, G, 8, 8, block_len=4, block_stride=2, dtype=F64)
    out = reference.window_attention(q, k, v, window=T + 3)
    torch.testing.assert_close(out, naive_masked_attention(q, k, v, causal(T), 8**-0.5))


def test_window_attends_to_exactly_w_keys():
    T, w = 40, 7
    q, _, _, _, _, k, v, _ = nsa_inputs(1, T, 2, 1, 8, 8, block_len=4, block_stride=2, dtype=F64)
    t = torch.arange(T)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - w)
    torch.testing.assert_close(
        reference.window_attention(q, k, v, window=w, scale=0.35), naive_masked_attention(q, k, v, allowed, 0.35)
    )


@pytest.mark.parametrize("T,sel_block,n_sel", [(50, 8, 7), (64, 16, 4), (3, 8, 3)])
def test_selection_covering_everything_is_dense_causal(T, sel_block, n_sel):
    q, k_cmp, _, k, v, _, _, _ = nsa_inputs(1, T, 6, 2, 8, 8, block_len=4, block_stride=2, dtype=F64)
    idx = select_blocks(q, k_cmp, block_len=4, block_stride=2, sel_block=sel_block, n_sel=n_sel)
    out = reference.selected_attention(q, k, v, idx, sel_block=sel_block)
    torch.testing.assert_close(out, naive_masked_attention(q, k, v, causal(T), 8**-0.5))


@pytest.mark.parametrize("T", [1, 19, 32])
def test_compression_with_unit_blocks_and_mean_is_dense_causal(T):
    q, _, _, _, _, k, v, _ = nsa_inputs(2, T, 4, 2, 8, 8, block_len=1, block_stride=1, dtype=F64)
    # l = d = 1 with mean phi: compressed token i is raw token i, visible iff i <= t.
    out = reference.compressed_attention(q, k, v, block_len=1, block_stride=1)
    torch.testing.assert_close(out, naive_masked_attention(q, k, v, causal(T), 8**-0.5))


def test_compressed_branch_is_zero_before_the_first_block_completes():
    q, k_cmp, v_cmp, *_ = nsa_inputs(1, 30, 2, 1, 4, 4, block_len=8, block_stride=4, dtype=F64)
    out = reference.compressed_attention(q, k_cmp, v_cmp, block_len=8, block_stride=4)
    assert out[:, :7].abs().max() == 0
    assert out[:, 7:].abs().min() > 0


# (B, T, H, G, Dk, Dv, l, d, l', n, w): odd T, T < l, T < l', T not a multiple of any block,
# group sizes 1, 3, 6 and 16, Dk != Dv, n larger than the number of blocks.
CASES = [
    (1, 45, 6, 1, 8, 8, 8, 4, 16, 3, 9),
    (2, 37, 6, 2, 4, 6, 4, 2, 8, 4, 5),
    (1, 7, 2, 2, 4, 4, 8, 4, 8, 3, 3),
    (1, 70, 16, 1, 4, 4, 8, 4, 8, 5, 20),
    (1, 33, 3, 3, 5, 3, 6, 3, 9, 3, 4),
    (1, 23, 4, 2, 4, 4, 4, 4, 4, 8, 64),
    (1, 9, 2, 1, 4, 4, 16, 8, 16, 3, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}-H{c[2]}-G{c[3]}" for c in CASES])
def test_reference_matches_literal_transcription(case):
    B, T, H, G, Dk, Dv, l, d, lp, n, w = case
    hp = dict(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=w)
    inputs = nsa_inputs(B, T, H, G, Dk, Dv, block_len=l, block_stride=d, dtype=F64, seed=T, requires_grad=True)
    expected, expected_idx = literal_nsa(*inputs, **hp)
    got = nsa_attention(*inputs, **hp)
    idx = select_blocks(inputs[0], inputs[1], block_len=l, block_stride=d, sel_block=lp, n_sel=n)
    assert idx.dtype == torch.int64 and idx.shape == (B, T, G, n)
    assert torch.equal(idx, expected_idx)
    torch.testing.assert_close(got, expected)
    grad_out = torch.randn_like(got)
    grads = torch.autograd.grad(got, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out, allow_unused=True)
    for name, g, e in zip(("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates"), grads, expected_grads):
        e = torch.zeros_like(g) if e is None else e
        torch.testing.assert_close(g, e, msg=lambda m: f"grad {name}: {m}")


def test_selection_scores_match_literal_eq9():
    q, k_cmp, *_ = nsa_inputs(2, 41, 6, 2, 8, 8, block_len=8, block_stride=4, dtype=F64, seed=3)
    _, expected = literal_selection(q, k_cmp, block_len=8, block_stride=4, sel_block=12, n_sel=4)
    got = reference.selection_scores(q, k_cmp, block_len=8, block_stride=4, sel_block=12)
    torch.testing.assert_close(got, expected)


def test_long_sequence_uses_several_query_chunks():
    # T above the reference's query chunk: chunk boundaries must not change anything.
    T = reference.QUERY_CHUNK + 45
    hp = dict(block_len=8, block_stride=4, sel_block=16, n_sel=4, window=24)
    inputs = nsa_inputs(1, T, 2, 1, 4, 4, block_len=8, block_stride=4, dtype=F64, seed=1)
    full = nsa_attention(*inputs, **hp)
    tail = T - 30
    # Output at t depends only on inputs <= t, so a prefix run must agree on the prefix.
    from nsa.ops.geometry import num_compressed_blocks

    nc = num_compressed_blocks(tail, 8, 4)
    prefix = [inputs[0][:, :tail], inputs[1][:, :nc], inputs[2][:, :nc]] + [t[:, :tail] for t in inputs[3:]]
    torch.testing.assert_close(nsa_attention(*prefix, **hp), full[:, :tail])


def test_low_precision_inputs_compute_in_float32_and_return_input_dtype():
    hp = dict(block_len=4, block_stride=2, sel_block=8, n_sel=3, window=6)
    inputs = nsa_inputs(1, 21, 4, 2, 8, 8, block_len=4, block_stride=2, dtype=torch.float32)
    ref = nsa_attention(*inputs, **hp)
    half = nsa_attention(*[t.to(torch.bfloat16) for t in inputs], **hp)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=0.05, atol=0.05)


def test_empty_sequence_gives_an_empty_output():
    hp = dict(block_len=4, block_stride=2, sel_block=8, n_sel=3, window=6)
    inputs = nsa_inputs(2, 0, 4, 2, 8, 6, block_len=4, block_stride=2, requires_grad=True)
    out = nsa_attention(*inputs, **hp)
    assert out.shape == (2, 0, 4, 6)
    grads = torch.autograd.grad(out.sum(), inputs)
    assert all(g.shape == x.shape for g, x in zip(grads, inputs))
