"""Which config keys a resumed run may change (nsa.train.resume_rules)."""

from nsa.train.resume_rules import APPLIED, FIXED, resume_rule, split_changes


def test_gate_loss_terms_the_window_and_attention_drop_are_applied_on_resume_and_the_models_shape_is_fixed():
    # A curriculum may turn the gates' loss terms or the attention's stochastic depth on, or widen the window, at a
    # later stage (recipes.sh --from-stage); the other hyper-parameters that shape what the model computes stay as
    # the checkpoint has them.
    for key in ("model.nsa.gate_floor", "model.nsa.gate_spread_penalty", "model.nsa.window", "model.attention_drop"):
        assert resume_rule(key) == APPLIED, key
    for key in ("model.nsa.gate", "model.nsa.block_len", "model.dim", "data.source"):
        assert resume_rule(key) == FIXED, key
    fixed, applied = split_changes({"model.nsa.gate_floor": (0.0, 0.02), "model.nsa.n_sel": (16, 8)})
    assert fixed == {"model.nsa.n_sel": (16, 8)} and applied == {"model.nsa.gate_floor": (0.0, 0.02)}
