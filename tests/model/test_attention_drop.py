"""model.attention_drop: stochastic depth on each block's attention, per sequence, in training only."""

import pytest
import torch

from nsa.config import load_config
from nsa.errors import ConfigError
from nsa.eval.ablation import ablated_attention
from nsa.model import Transformer
from nsa.model.config import ModelConfig


def small(attention: str, drop: float) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                   mlp_hidden=64, attention=attention, attention_drop=drop))


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_each_sequence_either_skips_the_attention_or_keeps_it_scaled(attention):
    p = 0.5
    model = small(attention, p)
    tokens = torch.randint(0, 64, (16, 70))
    with torch.no_grad():
        model.eval()  # evaluation keeps every layer, unscaled
        whole = model(tokens)
        with ablated_attention(model, [0]):
            skipped = model(tokens)
        model.layers[0].attn.wo.weight.mul_(1 / (1 - p))
        scaled = model(tokens)
        model.layers[0].attn.wo.weight.mul_(1 - p)
        assert torch.allclose(model(tokens), whole)
        model.train()
        torch.manual_seed(1)
        dropped = model(tokens)
    per_row = [(torch.allclose(d, s, atol=1e-5), torch.allclose(d, k, atol=1e-5))
               for d, s, k in zip(dropped, skipped, scaled)]
    assert all(a != b for a, b in per_row)  # every sequence is one of the two, whole sequences at a time
    assert 0 < sum(a for a, _ in per_row) < len(per_row)  # and both happen (each row is a coin flip)
    torch.manual_seed(1)
    with torch.no_grad():
        assert torch.equal(model(tokens), dropped)  # the default generator's state decides the masks


def test_no_drop_changes_nothing_in_training_and_a_probability_outside_0_1_is_refused():
    tokens = torch.randint(0, 64, (4, 40))
    with torch.no_grad():
        assert torch.equal(small("nsa", 0.0).train()(tokens), small("nsa", 0.0).eval()(tokens))
    with pytest.raises(ConfigError, match=r"model.attention_drop is a probability in \[0, 1\), got 1.0"):
        load_config(None, ["model.attention_drop=1.0"])


def test_a_run_with_attention_drop_resumes_with_the_uninterrupted_losses_exactly(tmp_path):
    from nsa.train.loop import train

    common = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
              "model.mlp_hidden=64", "train.seq_len=64", "train.batch_size=4", "train.steps=6",
              "train.warmup_steps=2", "train.eval_every=0", "train.log_every=1", "train.sample_tokens=0",
              "train.progress=false", "telemetry.tensorboard=false", "model.attention_drop=0.5",
              f"train.out_dir={tmp_path}"]
    full = train(load_config(None, common + ["train.run_name=full"]))
    part = train(load_config(None, common + ["train.run_name=cut", "train.stop_after=3"]))
    rest = train(load_config(None, common + ["train.run_name=cut"]))
    assert {**part.losses, **rest.losses} == full.losses  # the masks drawn after the resume are the same
    undropped = train(load_config(None, common + ["train.run_name=none", "model.attention_drop=0"]))
    assert undropped.losses[2] != full.losses[2]  # (the drop is at work from step 1 on; step 1's loss precedes it)
