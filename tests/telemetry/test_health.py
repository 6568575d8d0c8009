"""NSA health probe: its statistics against values computed directly from a plain forward, wrapper
independence (checkpoint_wrapper, compiled blocks, DDP/FSDP2 on one gloo rank), and no side effects."""

import copy
import dataclasses
import json
import math
import socket
from collections import Counter

import numpy as np
import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

import nsa.model.attention as attention_module
from nsa.model import Transformer, tiny
from nsa.model.selection_distill import selection_distillation
from nsa.ops import reference
from nsa.telemetry.health import distance_edges, probe, selection_sums, summarize
from nsa.telemetry.report import lowest_head_gate
from nsa.telemetry.run_files import layer_series

SEL_BLOCK, N_SEL, T = 32, 5, 200  # T not a multiple of SEL_BLOCK: the last span is partial


def tiny_cfg(**changes):
    cfg = tiny()
    nsa = dataclasses.replace(cfg.nsa, sel_block=SEL_BLOCK, n_sel=N_SEL, backend="reference")
    return dataclasses.replace(cfg, vocab_size=96, n_layers=3, nsa=nsa, **changes)


@pytest.fixture(scope="module")
def model_and_tokens():
    torch.manual_seed(0)
    model = Transformer(tiny_cfg())
    # Random (not freshly initialised) gates and compression MLPs, so the gates spread and selection varies.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name or "compress" in name:
                p.normal_(0, 0.3)
    return model, torch.randint(0, 96, (2, T))


def direct_stats(model, tokens):
    """Per layer: q, compressed keys, gates and the selected branch's keys as the plain forward passes them to
    nsa_attention."""
    captured = []
    real = attention_module.nsa_attention

    def spy(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, **kw):
        captured.append((q, k_cmp, gates, k_sel))
        return real(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, **kw)

    attention_module.nsa_attention = spy
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        attention_module.nsa_attention = real
    return captured


def expected_layer(q, k_cmp, gates, nsa):
    g = gates.double().reshape(-1, 3)
    shares = g / g.sum(-1, keepdim=True)
    idx = reference.select_blocks(q, k_cmp, block_len=nsa.block_len, block_stride=nsa.block_stride,
                                  sel_block=nsa.sel_block, n_sel=nsa.n_sel)
    distances, forced, free = [], 0, Counter()
    for b, t, grp, slot in (idx >= 0).nonzero().tolist():
        j = idx[b, t, grp, slot].item()
        distances.append(t - j * nsa.sel_block)
        if j in (0, t // nsa.sel_block, t // nsa.sel_block - 1):
            forced += 1
        else:
            free[(b, grp, t // nsa.sel_block, j)] += 1
    span_size = lambda s: min(nsa.sel_block, T - s * nsa.sel_block)  # noqa: E731
    concentration = sum(c * c / span_size(key[2]) for key, c in free.items()) / sum(free.values())
    return {
        "gate_mean": g.mean(0).tolist(),
        "gate_std": g.std(0, unbiased=False).tolist(),
        "gate_entropy": float(-(shares * shares.log()).sum(-1).mean()),
        "sel_distance_mean": float(np.mean(distances)),
        "sel_forced_share": forced / len(distances),
        "sel_concentration": concentration,
        "hist": np.histogram(distances, bins=distance_edges(nsa.sel_block, T))[0].tolist(),
    }


def test_probe_matches_statistics_computed_directly(model_and_tokens):
    model, tokens = model_and_tokens
    sums = probe(model, tokens)
    L, K = 3, len(distance_edges(SEL_BLOCK, T)) - 1
    assert distance_edges(SEL_BLOCK, T) == [0, 32, 64, 128, 256]
    for key, value in sums.items():
        assert value.dtype in (torch.float64, torch.int64), key
        assert value.shape[0] == L and not value.requires_grad, key
    assert sums["gate_sum"].shape == (L, 3) and sums["distance_counts"].shape == (L, K)
    record = summarize(sums, distance_edges(SEL_BLOCK, T))
    json.dumps(record, allow_nan=False)
    assert record["distance_edges"] == [0.0, 32.0, 64.0, 128.0, 256.0]
    nsa = model.cfg.nsa
    for i, (q, k_cmp, gates, k_sel) in enumerate(direct_stats(model, tokens)):
        want, got = expected_layer(q, k_cmp, gates, nsa), record["layers"][i]
        assert got["layer"] == i
        for key in ("gate_mean", "gate_std"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (i, key)
        head_means = gates.double().flatten(0, -3).mean(0)  # [heads, 3]: each head over every token
        assert got["gate_head_min"] == pytest.approx(head_means.min(0).values.tolist(), rel=1e-9)
        assert (np.array(got["gate_head_min"]) < np.array(got["gate_mean"]) - 1e-3).all()  # heads differ
        for key in ("gate_entropy", "sel_distance_mean", "sel_forced_share", "sel_concentration"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (i, key)
        assert record["distance_counts"][i] == want["hist"]
        kl = selection_distillation(q, k_cmp, k_sel, nsa.geometry, nsa.selection_distill_queries)
        assert got["sel_kl"] == pytest.approx(kl.item(), rel=1e-5) and got["sel_kl"] > 0
        # Query t has min(n_sel, t // sel_block + 1) valid slots, per batch row and kv group.
        slots = sum(min(N_SEL, t // SEL_BLOCK + 1) for t in range(T)) * 2 * model.cfg.n_kv_heads
        assert sum(want["hist"]) == int(sums["sel_count"][i]) == slots
        # Sanity of the sample: gates are spread, some selection is free and not all in one place.
        assert min(got["gate_std"]) > 0.01 and 0 < got["gate_entropy"] < math.log(3)
        assert 0.5 < got["sel_forced_share"] < 1 and 0 < got["sel_concentration"] < 1
    assert int(sums["gate_count"][0]) == 2 * T * model.cfg.n_heads


def test_selection_sums_on_hand_made_indices():
    # sel_block=4, T=16: four spans of four queries. Forced blocks per span: {0}, {0,1}, {0,1,2}, {0,2,3};
    # in the last span queries 12 and 13 also choose the free block 1.
    idx = torch.full((1, 16, 1, 4), -1)
    for t in range(16):
        jt = t // 4
        row = sorted({0, jt, max(jt - 1, 0)} | ({1} if t in (12, 13) else set()))
        idx[0, t, 0, : len(row)] = torch.tensor(row)
    s = selection_sums(idx, sel_block=4, seq_len=16)
    assert int(s["sel_count"]) == 4 * 1 + 4 * 2 + 4 * 3 + 4 * 3 + 2
    assert int(s["sel_forced_count"]) == 4 * 1 + 4 * 2 + 4 * 3 + 4 * 3
    # Each of the two free slots sees 2 of its span's 4 queries choosing block 1: concentration 0.5.
    assert float(s["sel_concentration_sum"]) / 2 == pytest.approx(0.5)
    assert distance_edges(4, 16) == [0, 4, 8, 16]
    dist = [t - j * 4 for t in range(16) for j in idx[0, t, 0].tolist() if j >= 0]
    assert s["distance_counts"].tolist() == np.histogram(dist, bins=[0, 4, 8, 16])[0].tolist()
    assert int(s["sel_distance_sum"]) == sum(dist)
    # All four queries of the last span choosing block 1 is full concentration.
    idx[0, 14:16, 0, 3] = 1
    idx[0, 14:16, 0] = idx[0, 14:16, 0].sort(-1).values
    s = selection_sums(idx, sel_block=4, seq_len=16)
    assert float(s["sel_concentration_sum"]) / 4 == pytest.approx(1.0)


def test_probe_ignores_checkpoint_and_compile_wrappers(model_and_tokens):
    model, tokens = model_and_tokens
    wrapped = copy.deepcopy(model)

    def refuse(gm, example_inputs):
        raise AssertionError("the probe must not run the compiled __call__")

    for i, block in enumerate(wrapped.layers):
        block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        block.compile(backend=refuse)
        wrapped.layers[i] = block
    got, want = probe(wrapped, tokens), probe(model, tokens)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_dense_model_gives_none():
    assert probe(Transformer(tiny_cfg(attention="dense")), torch.randint(0, 96, (1, 40))) is None


def test_probe_has_no_side_effects(model_and_tokens):
    model, tokens = model_and_tokens
    with torch.no_grad():
        before = model(tokens)
    model.train()
    assert all(p.grad is None for p in model.parameters())
    with torch.enable_grad():
        sums = probe(model, tokens)
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert not any(v.requires_grad for v in sums.values())
    with torch.no_grad():
        assert torch.equal(model(tokens), before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_probe_under_ddp_and_fsdp2_on_one_rank(mode, model_and_tokens):
    import torch.distributed as dist

    from nsa.train.config import ParallelConfig
    from nsa.train.distributed import DistInfo
    from nsa.train.parallel import apply_parallelism

    model, tokens = model_and_tokens
    want = probe(model, tokens)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        cfg = ParallelConfig(mode=mode, activation_checkpointing=True, compile=True)
        wrapped = apply_parallelism(copy.deepcopy(model), cfg, info, mode, bf16=False)
        got = probe(wrapped, tokens)
        if mode == "fsdp":  # parameters are sharded again afterwards
            assert all(type(p).__name__ == "DTensor" for p in wrapped.parameters())
    finally:
        dist.destroy_process_group()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-6, atol=0), key


def test_the_compiled_loss_under_fsdp2_gives_the_plain_models_loss_and_gradients(model_and_tokens):
    """apply_parallelism compiles the loss, which takes the tied output weight as an argument: under FSDP2 that is
    the gathered parameter during forward, and its gradient must still reach the (sharded) embedding."""
    import torch.distributed as dist

    from nsa.train.config import ParallelConfig
    from nsa.train.distributed import DistInfo
    from nsa.train.parallel import apply_parallelism

    model, tokens = model_and_tokens
    plain = copy.deepcopy(model)
    want = plain(tokens[:, :-1], tokens[:, 1:])
    want.backward()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        wrapped = apply_parallelism(copy.deepcopy(model), ParallelConfig(mode="fsdp", compile=True), info, "fsdp",
                                    bf16=False)
        got = wrapped(tokens[:, :-1], tokens[:, 1:])
        got.backward()
        grad = wrapped.tok_emb.weight.grad.full_tensor()
    finally:
        dist.destroy_process_group()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(grad, plain.tok_emb.weight.grad, rtol=1e-4, atol=1e-6)



# ------------------------------------------------------------------------------ a training run's gate watch


def collapse_gates(model: Transformer) -> None:
    """Set every NSA layer's gate MLP so that each gate is ~0 for any input: the hidden units come in pairs
    (w, -w), whose silu outputs sum to a * tanh(a / 2) >= 0 for a = w . x, and the output layer weighs every
    hidden unit -1, so each gate's logit is minus a sum of such terms. With w ~ N(0, 4) and inputs of unit RMS, each
    |a| is about 2 sqrt(dim): with 8 pairs at dim 32 the logits are near -70, where the sigmoid's gradient is far
    below Adam's eps, so a few steps of training leave the gates closed."""
    with torch.no_grad():
        for block in model.layers:
            gate = block.attn.gate
            half = gate.fc1.out_features // 2
            w = 2 * torch.randn(half, gate.fc1.in_features)
            gate.fc1.weight.copy_(torch.cat([w, -w, torch.zeros(gate.fc1.out_features - 2 * half, w.shape[1])]))
            gate.fc2.weight.fill_(-1.0)


RETRIEVAL_RUN = [
    "model.attention=nsa", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "model.head_dim=16", "model.mlp_hidden=64", "model.nsa.gate_hidden=16", "data.source=retrieval",
    "data.retrieval.task=kv", "data.retrieval.kv_pairs=3", "train.seq_len=128", "train.batch_size=2",
    "train.steps=4", "train.warmup_steps=1", "train.eval_every=0", "train.log_every=1", "train.sample_tokens=0",
    "train.progress=false", "telemetry.health_every=2", "telemetry.tensorboard=false",
]


@pytest.mark.parametrize("forced", [True, False], ids=["collapsed", "healthy"])
def test_a_training_run_warns_about_collapsed_gates_only_when_they_are(forced, tmp_path, monkeypatch, capsys):
    """A few steps of retrieval training: with every gate forced to ~0, the trainer's health statistics record the
    collapse, and it prints and logs one warning per layer and branch; without the forcing, none."""
    from nsa.config import load_config
    from nsa.train import loop

    class CollapsedGates(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            collapse_gates(self)

    if forced:
        monkeypatch.setattr(loop, "Transformer", CollapsedGates)
    loop.train(load_config(None, RETRIEVAL_RUN + [f"train.out_dir={tmp_path}", "train.run_name=run"]))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "nsa_stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4]
    means = np.array([[layer["gate_mean"] for layer in r["layers"]] for r in records])  # [records, layers, 3]
    events = [json.loads(line) for line in (run / "heartbeat_rank0.jsonl").read_text().splitlines()]
    warnings = [e for e in events if e["event"] == "warning"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    if forced:
        assert means.max() < 1e-6
        expected = [f"layer {layer}: the {branch} gate collapsed to 0.000 (mean over heads and tokens)"
                    for layer in range(2) for branch in ("compressed", "selected", "window")]
        assert [(e["step"], e["message"]) for e in warnings] == [(1, m) for m in expected]  # once each, not again
        assert printed == [f"warning: step 1: {m}" for m in expected]
    else:
        assert 0.1 < means.min() and means.max() < 0.9
        assert warnings == [] and printed == []


def switch_off_compressed_branch(model: Transformer) -> None:
    """Set every NSA layer's softmax gate so that the compressed branch's share is ~0 for any input and the other
    two share the rest: the hidden units come in pairs (w, -w) whose silu outputs sum to a * tanh(a / 2) >= 0, and
    the output layer weighs each of them -5 for the compressed logit and 0 for the others (logits near -20)."""
    with torch.no_grad():
        for block in model.layers:
            gate = block.attn.gate
            half = gate.fc1.out_features // 2
            w = torch.randn(half, gate.fc1.in_features) / gate.fc1.in_features ** 0.5
            gate.fc1.weight.copy_(torch.cat([w, -w]))
            rows = gate.fc2.weight.view(-1, 3, gate.fc1.out_features)  # [heads, branch, hidden]
            rows[:, 0].fill_(-5.0)
            rows[:, 1:].zero_()


@pytest.mark.parametrize("floor", [0.0, 0.02], ids=["no-floor", "floor"])
def test_the_gate_floor_brings_a_switched_off_branch_back_in_training(floor, tmp_path, monkeypatch):
    """A short retrieval run whose softmax gates start with the compressed branch switched off in every layer: the
    loss alone leaves it off (a share near 0 has a gradient near 0); with model.nsa.gate_floor the trainer's health
    records show it back in every layer."""
    from nsa.config import load_config
    from nsa.train import loop

    class SwitchedOff(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            switch_off_compressed_branch(self)

    monkeypatch.setattr(loop, "Transformer", SwitchedOff)
    loop.train(load_config(None, RETRIEVAL_RUN + [
        f"train.out_dir={tmp_path}", "train.run_name=run", "model.nsa.gate=softmax", f"model.nsa.gate_floor={floor}",
        "train.steps=20", "train.lr=3e-3", "telemetry.health_every=5"]))
    records = [json.loads(line) for line in (tmp_path / "run" / "nsa_stats.jsonl").read_text().splitlines()]
    compressed = np.array([[layer["gate_mean"][0] for layer in r["layers"]] for r in records])  # [records, layers]
    assert len(records) == 5
    lowest, step, layer, branch, below, of = lowest_head_gate(layer_series(records))
    if floor:
        assert (compressed.mean(0) > 0.02).all() and (compressed[1:].max(0) > 0.04).all()
        assert below < 5  # the floor lifts every head of every layer, not only the layers' means
    else:
        assert compressed.max() < 1e-3
        assert (lowest, branch, below, of) == (pytest.approx(0, abs=1e-3), "compressed", 5, 5)
