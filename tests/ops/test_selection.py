"""Top-n selection semantics: forced blocks, ties, padding, one selection per group."""

import dataclasses

import pytest
import torch

from helpers import nsa_inputs
from nsa.ops import NSAGeometry, reference, select_blocks


def chosen_sets(idx):
    return [set(int(j) for j in row if j >= 0) for row in idx.reshape(-1, idx.shape[-1])]


def test_forced_blocks_are_always_selected():
    T, lp, n = 200, 16, 4
    scores = torch.rand(2, T, 3, 13)
    idx = reference.top_n_blocks(scores, sel_block=lp, n_sel=n)
    for b in range(2):
        for t in range(T):
            for g in range(3):
                s = set(idx[b, t, g].tolist()) - {-1}
                jt = t // lp
                assert {0, jt, max(jt - 1, 0)} <= s


def test_remaining_places_go_to_the_highest_scores():
    T, lp, n = 160, 8, 6
    scores = torch.rand(1, T, 1, 20)
    idx = reference.top_n_blocks(scores, sel_block=lp, n_sel=n)
    for t in range(T):
        jt = t // lp
        forced = {0, jt, max(jt - 1, 0)}
        chosen = set(idx[0, t, 0].tolist()) - {-1}
        free = chosen - forced
        rest = set(range(jt + 1)) - chosen
        if free and rest:
            assert min(scores[0, t, 0, j] for j in free) >= max(scores[0, t, 0, j] for j in rest)
        assert len(chosen) == min(n, jt + 1)


def test_ties_go_to_the_lower_block_index():
    T, lp, n = 100, 10, 5
    scores = torch.zeros(1, T, 1, 10)
    scores[..., 6] = 1.0  # one clear winner; the rest tie at 0
    idx = reference.top_n_blocks(scores, sel_block=lp, n_sel=n)
    # t = 99: j_t = 9, forced {0, 8, 9}; then block 6 (highest), then the tie between 1..5, 7 -> 1.
    assert idx[0, 99, 0].tolist() == [0, 1, 6, 8, 9]
    # t = 55: j_t = 5, forced {0, 4, 5}; candidates 1, 2, 3 all tie at 0 -> 1, 2.
    assert idx[0, 55, 0].tolist() == [0, 1, 2, 4, 5]


def test_fewer_candidates_than_n_selects_all_and_pads_with_minus_one():
    T, lp, n = 50, 16, 8
    idx = reference.top_n_blocks(torch.rand(1, T, 2, 4), sel_block=lp, n_sel=n)
    for t in [0, 15, 16, 31, 32, 49]:
        jt = t // lp
        row = idx[0, t, 1].tolist()
        assert row == list(range(jt + 1)) + [-1] * (n - jt - 1)


def test_output_is_sorted_causal_unique_and_padded_at_the_end():
    B, T, H, G = 2, 93, 6, 2
    q, k_cmp, *_ = nsa_inputs(B, T, H, G, 8, 8, block_len=8, block_stride=4, seed=5)
    idx = select_blocks(q, k_cmp, block_len=8, block_stride=4, sel_block=8, n_sel=5)
    assert idx.shape == (B, T, G, 5) and idx.dtype == torch.int64
    t = torch.arange(T)[None, :, None, None]
    valid = idx >= 0
    assert (idx[valid] * 8 <= t.expand_as(idx)[valid]).all(), "a selected block starts after the query"
    for row in idx.reshape(-1, 5).tolist():
        kept = [j for j in row if j >= 0]
        assert kept == sorted(set(kept))
        assert row[len(kept):] == [-1] * (5 - len(kept))


@pytest.mark.parametrize("T", [1, 5, 7, 8, 9, 63])
def test_short_and_odd_sequences(T):
    q, k_cmp, *_ = nsa_inputs(1, T, 4, 2, 4, 4, block_len=8, block_stride=4, seed=T)
    idx = select_blocks(q, k_cmp, block_len=8, block_stride=4, sel_block=8, n_sel=3)
    for t in range(T):
        jt = t // 8
        assert sorted(set(idx[0, t, 0].tolist()) - {-1}) == sorted({0, jt, max(0, jt - 1)})


def test_heads_of_a_group_share_one_selection_from_their_summed_scores():
    B, T, H, G = 1, 120, 6, 2
    q, k_cmp, *_ = nsa_inputs(B, T, H, G, 8, 8, block_len=8, block_stride=4, seed=11)
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=4)
    idx = select_blocks(q, k_cmp, **hp)
    # Permuting heads inside a group leaves its summed scores, hence its selection, unchanged.
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    assert torch.equal(select_blocks(q[:, :, perm], k_cmp, **hp), idx)
    # Changing group 1's heads changes nothing in group 0.
    q2 = q.clone()
    q2[:, :, 3:] = torch.randn_like(q2[:, :, 3:])
    idx2 = select_blocks(q2, k_cmp, **hp)
    assert torch.equal(idx2[..., 0, :], idx[..., 0, :])
    assert not torch.equal(idx2[..., 1, :], idx[..., 1, :])


def test_bad_hyperparameters_are_rejected():
    q, k_cmp, *_ = nsa_inputs(1, 40, 4, 2, 4, 4, block_len=8, block_stride=4)
    with pytest.raises(ValueError, match="must divide"):
        select_blocks(q, k_cmp, block_len=8, block_stride=3, sel_block=8, n_sel=3)
    with pytest.raises(ValueError, match="n_sel must be >= 3"):
        select_blocks(q, k_cmp, block_len=8, block_stride=4, sel_block=8, n_sel=2)
    with pytest.raises(ValueError, match="k_cmp must be"):
        select_blocks(q, k_cmp[:, :-1], block_len=8, block_stride=4, sel_block=8, n_sel=3)
    with pytest.raises(ValueError, match="multiple of key/value groups"):
        select_blocks(q[:, :, :3], k_cmp, block_len=8, block_stride=4, sel_block=8, n_sel=3)


def test_the_geometry_checks_its_rules_once_and_stands_for_the_keywords():
    geometry = NSAGeometry(8, 4, 8, 3, 5)
    assert geometry.as_tuple() == (8, 4, 8, 3, 5)
    assert (geometry.num_compressed_blocks(40), geometry.num_selection_blocks(41)) == (9, 6)
    assert geometry.num_compressed_blocks(7) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        geometry.window = 6
    for values, message in [((0, 4, 8, 3, 5), "block_len must be >= 1, got 0"),
                            ((8, 4, 8, 3, 0), "window must be >= 1, got 0"),
                            ((8, 3, 9, 3, 5), r"block_stride \(3\) must divide block_len \(8\)"),
                            ((8, 4, 8, 2, 5), "n_sel must be >= 3"),
                            ((8.5, 4, 8, 3, 5), "block_len must be an integer, got 8.5")]:
        with pytest.raises(ValueError, match=message):
            NSAGeometry(*values)
    q, k_cmp, *_ = nsa_inputs(1, 40, 4, 2, 4, 4, block_len=8, block_stride=4)
    keywords = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3)
    assert torch.equal(select_blocks(q, k_cmp, geometry=geometry), select_blocks(q, k_cmp, **keywords))
    with pytest.raises(ValueError, match="not both"):
        select_blocks(q, k_cmp, geometry=geometry, **keywords)
    with pytest.raises(ValueError, match="missing n_sel"):
        select_blocks(q, k_cmp, block_len=8, block_stride=4, sel_block=8)
