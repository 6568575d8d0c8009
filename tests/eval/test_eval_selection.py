"""nsa.eval.selection: which blocks NSA selects at the answer query, and whether they hold the needle."""

import dataclasses

import torch

from nsa.eval.selection import needle_selected, record_selection
from nsa.model import Transformer, tiny
from nsa.ops import reference


def test_needle_selected_checks_every_block_the_needle_overlaps():
    # One layer, one query per row, two kv groups, n = 3; -1 is an unused slot.
    selected = [torch.tensor([[[[0, 3, 5], [0, 1, -1]]]]).expand(3, -1, -1, -1)]
    start = torch.tensor([200, 60, 320])  # blocks of 64: needle 3; needle 0-1 (60..69); needle 5 only
    length = torch.tensor([40, 10, 64])
    found = needle_selected(selected, start, length, sel_block=64)
    assert found.shape == (3, 1, 2)
    assert found[:, 0].tolist() == [[True, False], [True, True], [True, False]]
    # A needle of one token at the last position of block 2 is in none of the chosen blocks.
    assert not needle_selected(selected, torch.tensor([191]), torch.tensor([1]), 64).any()
    # Several queries per row ([B,P,G,n]): a group counts when any of its queries chose the needle.
    per_query = [torch.tensor([[[[0, 1, -1]], [[0, 2, -1]]], [[[0, 1, -1]], [[0, 1, -1]]]])]  # B 2, P 2, G 1
    found = needle_selected(per_query, torch.tensor([130, 130]), torch.tensor([10, 10]), sel_block=64)
    assert found.shape == (2, 1, 1) and found[:, 0, 0].tolist() == [True, False]


def test_record_selection_returns_what_each_layer_selects_at_the_query():
    cfg = tiny()
    cfg = dataclasses.replace(cfg, vocab_size=256, n_layers=2, nsa=dataclasses.replace(cfg.nsa, backend="reference"))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 256, (2, 150))
    query = torch.tensor([149, 97])
    with torch.no_grad(), record_selection(model, query[:, None]) as record:
        model.hidden(tokens)
    records = record.blocks
    # The same selection, computed by walking the layers by hand with the reference.
    expected, expected_gates = [], []
    with torch.no_grad():
        cos, sin = model.rope(torch.arange(tokens.shape[1]))
        x = model.tok_emb(tokens)
        for layer in model.layers:
            attn, nsa = layer.attn, cfg.nsa
            p = attn.project(layer.attn_norm(x), cos, sin)
            idx = reference.select_blocks(p["q"], attn.compress_k(p["k_cmp"]), block_len=nsa.block_len,
                                          block_stride=nsa.block_stride, sel_block=nsa.sel_block, n_sel=nsa.n_sel)
            expected.append(idx[torch.arange(2), query])
            expected_gates.append(p["gates"][torch.arange(2), query].mean(1))  # [2,3]: mean over heads
            x = layer(x, cos, sin)
    assert len(records) == 2
    for got, want in zip(records, expected):
        assert torch.equal(got[:, 0], want)
    for got, want in zip(record.gates, expected_gates):
        torch.testing.assert_close(got, want)
    # Query 97 lies in block 3 (sel_block 32): its forced blocks 0, 2 and 3 are among what it selected.
    assert {0, 2, 3} <= set(records[0][1, 0, 0].tolist())
    # Several queries per row: the same selection at the first, [B,P,G,n].
    queries = torch.stack([query, query - 1, query - 40], 1)
    with torch.no_grad(), record_selection(model, queries) as several_record:
        model.hidden(tokens)
    several = several_record.blocks
    for got, one in zip(several, records):
        assert got.shape == (2, 3) + one.shape[2:] and torch.equal(got[:, :1], one)
    assert not torch.equal(several[0][:, 0], several[0][:, 2])  # other queries, other choices
    # The hooks are gone afterwards.
    with torch.no_grad():
        model.hidden(tokens)
    assert len(records) == 2
