"""Layer ablation for `nsa eval --ablate-attention`: the named layers' attention outputs zeros while active,
and only while active."""

import copy

import pytest
import torch

from nsa.errors import UserError
from nsa.eval.ablation import ablated_attention, parse_layers
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
