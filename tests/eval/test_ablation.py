"""Layer ablation for `nsa eval --ablate-attention`: the named layers' attention outputs zeros while active,
and only while active."""

import copy

import pytest
import torch

from nsa.errors import UserError
from nsa.eval.ablation import ablated_attention, parse_layers
from nsa.eval.intervals import wilson_interval
from nsa.eval.layer_sweep import pooled_by_length, sweep
from nsa.model import Transformer
from nsa.model.config import ModelConfig


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_an_ablated_layer_is_the_layer_without_its_attention_output(attention):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16, mlp_hidden=64,
                      attention=attention)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 64, (2, 80))
    with torch.no_grad():
        before = model(tokens)
        with ablated_attention(model, [1]):
            ablated = model(tokens)
        after = model(tokens)
        without = copy.deepcopy(model)
        without.layers[1].attn.wo.weight.zero_()  # the attention's output projection: no bias
        expected = without(tokens)
    assert torch.allclose(ablated, expected, atol=1e-6)
    assert not torch.allclose(ablated, before, atol=1e-3)  # the layer's attention mattered
    assert torch.equal(after, before)  # and is back once the context ends


def test_layers_are_parsed_and_checked_against_the_model():
    assert parse_layers("3, 2,3") == [2, 3] and parse_layers("") == []
    with pytest.raises(UserError, match="'x' is not a layer index"):
        parse_layers("1,x")
    with pytest.raises(UserError, match="'-1' is not a layer index"):
        parse_layers("-1")
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                    mlp_hidden=64)).eval()
    tokens = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        before = model(tokens)
        with pytest.raises(UserError, match="layer 2 does not exist; the model has layers 0-1"):
            with ablated_attention(model, [0, 2]):
                pass
        assert torch.equal(model(tokens), before)  # the refused call left no layer ablated


def test_the_sweep_removes_each_layer_alone_in_turn_and_pools_over_depths():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                                    mlp_hidden=64)).eval()
    tokens = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        expected = {}
        for layer in range(3):
            without = copy.deepcopy(model)
            without.layers[layer].attn.wo.weight.zero_()
            expected[layer] = without(tokens)
        whole = model(tokens)

    def score():  # which layer is missing now, told by the model's output; encoded in the cells' hit counts
        with torch.no_grad():
            now = model(tokens)
        missing = [i for i, out in expected.items() if torch.allclose(now, out, atol=1e-6)]
        assert len(missing) == 1 or (not missing and torch.equal(now, whole))
        hits = 1 + missing[0] if missing else 0
        return [{"task": "passkey", "length": n, "depth": d, "samples": 4, "correct": hits, "first_token": hits / 4}
                for n in (128, 256) for d in (0.0, 1.0)]

    rows = sweep(model, score, announce=lambda line: None)
    assert [(r["ablated"], r["length"], r["correct"]) for r in rows] == [
        ("none", 128, 0), ("none", 256, 0), ("0", 128, 2), ("0", 256, 2), ("1", 128, 4), ("1", 256, 4),
        ("2", 128, 6), ("2", 256, 6)]
    with torch.no_grad():
        assert torch.equal(model(tokens), whole)  # nothing left ablated


def test_the_sweep_pools_a_lengths_depths_into_one_interval():
    cells = [{"task": "kv", "length": 512, "depth": 0.0, "samples": 8, "correct": 6, "first_token": 1.0},
             {"task": "kv", "length": 512, "depth": 1.0, "samples": 8, "correct": 2, "first_token": 0.5},
             {"task": "kv", "length": 1024, "depth": 0.0, "samples": 8, "correct": 8, "first_token": 1.0}]
    short, long = pooled_by_length(cells, "3")
    assert (short["ablated"], short["samples"], short["correct"], short["accuracy"]) == ("3", 16, 8, 0.5)
    assert (short["ci_low"], short["ci_high"]) == wilson_interval(8, 16) and short["first_token"] == 0.75
    assert (long["length"], long["samples"], long["accuracy"]) == (1024, 8, 1.0)
