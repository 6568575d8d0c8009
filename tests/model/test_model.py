"""The model: presets, parameter count, forward/backward for NSA and dense, phi, RoPE."""

import dataclasses

import pytest
import torch

from nsa.model import Transformer, m7c, preset, tiny
from nsa.model.compression import BlockCompressor
from nsa.model.rope import RotaryEmbedding, apply_rope


def small(**changes):
    return dataclasses.replace(tiny(), vocab_size=96, **changes)


def test_m7c_has_about_125m_parameters_and_the_design_shape():
    cfg = m7c()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden) == (768, 12, 12, 2, 64, 2048)
    n = cfg.nsa
    assert (n.block_len, n.block_stride, n.sel_block, n.n_sel, n.window, n.phi) == (32, 16, 64, 16, 512, "mlp")
    with torch.device("meta"):
        model = Transformer(cfg)
        dense = Transformer(dataclasses.replace(cfg, attention="dense"))
    assert 120e6 <= model.num_parameters() <= 125e6
    assert dense.num_parameters() < model.num_parameters()
    assert model.lm_head.weight is model.tok_emb.weight


def test_preset_lookup():
    assert preset("m7c") == m7c() and preset("tiny") == tiny()
    from nsa.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("m8x")


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_forward_backward_reaches_every_parameter(attention):
    torch.manual_seed(0)
    model = Transformer(small(attention=attention))
    tokens = torch.randint(0, 96, (2, 80))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(96.0)).item()) < 0.5
    loss.backward()
    # phi's last layer starts at zero, so one step first makes the paths through it live.
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, no_grad
    zero = [n for n, p in model.named_parameters() if p.grad.abs().max() == 0 and "compress" not in n]
    assert not zero, zero
    logits = model(tokens)
    assert logits.shape == (2, 80, 96)


def test_the_compiled_loss_matches_the_logits_cross_entropy_and_its_gradients():
    """The trainer compiles NextTokenLoss (parallel.compile); it must give what eager float32 logits give,
    ignored targets (-1) included, for the hidden states and the tied weight."""
    torch.manual_seed(0)
    model = Transformer(small(attention="dense"))
    tokens = torch.randint(0, 96, (2, 33))
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -1
    h = model.hidden(tokens[:, :-1]).detach().requires_grad_(True)
    w = model.lm_head.weight.detach().clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), targets.flatten(), ignore_index=-1)
    want_grads = torch.autograd.grad(want, (h, w))
    model.loss.compile()
    got = model.loss(h, w, targets)
    got_grads = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, want_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert model(tokens[:, :-1], targets).item() == pytest.approx(want.item(), rel=1e-5)


def test_shared_kv_uses_one_projection_for_all_branches():
    sep = Transformer(small())
    shared = Transformer(small(nsa=dataclasses.replace(small().nsa, shared_kv=True)))
    width = lambda m: m.layers[0].attn.wkv.weight.shape[0]  # noqa: E731
    assert width(sep) == 3 * width(shared)
    tokens = torch.randint(0, 96, (1, 40))
    assert torch.isfinite(shared(tokens[:, :-1], tokens[:, 1:]))


def test_mlp_phi_starts_as_mean_pooling_and_then_learns():
    comp = BlockCompressor(head_dim=8, block_len=4, block_stride=2, kind="mlp", hidden=16)
    x = torch.randn(2, 11, 3, 8)
    out = comp(x)
    assert out.shape == (2, 4, 3, 8)  # Nc = (11 - 4) // 2 + 1
    expected = torch.stack([x[:, i * 2 : i * 2 + 4].mean(1) for i in range(4)], dim=1)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    assert comp.fc2.weight.grad.abs().max() > 0
    assert BlockCompressor(8, 4, 2, "mean")(x[:, :3]).shape == (2, 0, 3, 8)


def test_mlp_phi_is_the_mean_plus_an_mlp_of_each_flattened_block_with_positions():
    torch.manual_seed(0)
    comp = BlockCompressor(head_dim=8, block_len=4, block_stride=2, kind="mlp", hidden=16).double()
    for w in (comp.pos, comp.fc1.weight, comp.fc2.weight):  # fc2 starts at zero: randomise so the MLP counts
        torch.nn.init.normal_(w, std=0.5)
    x = torch.randn(2, 11, 3, 8, dtype=torch.float64, requires_grad=True)
    literal = []  # block i covers tokens [2i, 2i + 4); its positions are added token by token before fc1
    for i in range(4):
        block = x[:, 2 * i : 2 * i + 4].transpose(1, 2)  # [B, G, l, D]
        mlp = comp.fc2(torch.nn.functional.silu(comp.fc1((block + comp.pos).flatten(-2))))
        literal.append(block.mean(2) + mlp)
    literal = torch.stack(literal, dim=1)
    out = comp(x)
    torch.testing.assert_close(out, literal)
    weights = torch.randn_like(out)
    params = [x, comp.pos, comp.fc1.weight, comp.fc2.weight]
    got = torch.autograd.grad((out * weights).sum(), params)
    want = torch.autograd.grad((literal * weights).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([pq]))
        ck, sk = rope(torch.tensor([pk]))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102))
    torch.testing.assert_close(score(1000, 990), score(10, 0), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_a_pinned_dense_kernel_gives_what_sdpa_chooses_and_is_the_kernel_that_runs():
    """model.dense_backend pins SDPA's kernel (dense:flash in nsa bench train): same numbers as PyTorch's own
    choice, and the pin is real: the math kernel, pinned, runs no flash kernel."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (2, 40))
    auto = Transformer(small(attention="dense"))
    for backend in ("flash", "math"):
        pinned = Transformer(small(attention="dense", dense_backend=backend))
        pinned.load_state_dict(auto.state_dict())
        torch.testing.assert_close(pinned(tokens), auto(tokens), rtol=1e-4, atol=1e-5)
    with torch.profiler.profile() as prof:
        pinned(tokens)
    ops = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops, ops
    with torch.profiler.profile() as prof:
        Transformer(small(attention="dense", dense_backend="flash"))(tokens)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {e.name for e in prof.events()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
@pytest.mark.parametrize("backend,op", [("flash", "aten::_scaled_dot_product_flash_attention"),
                                        ("cudnn", "aten::_scaled_dot_product_cudnn_attention")])
def test_a_pinned_dense_kernel_runs_on_the_gpu_forward_and_backward(backend, op):
    """M7C's head shape in bf16, as nsa bench train's dense:flash row runs it (the pinned kernel, with gradients)."""
    torch.manual_seed(0)
    cfg = small(attention="dense", dense_backend=backend, n_heads=12, n_kv_heads=2, head_dim=64, dim=768)
    model = Transformer(cfg).cuda()
    tokens = torch.randint(0, 96, (2, 512), device="cuda")
    with torch.profiler.profile() as prof, torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert op in {e.name for e in prof.events()}
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_softmax_gates_are_shares_of_the_same_logits_and_sigmoid_gates_are_not():
    from nsa.model.attention import GateMLP
    torch.manual_seed(0)
    sigmoid, softmax = GateMLP(16, 8, 4, "sigmoid"), GateMLP(16, 8, 4, "softmax")
    softmax.load_state_dict(sigmoid.state_dict())
    x = torch.randn(2, 5, 16)
    g_sig, g_soft = sigmoid(x), softmax(x)  # [2,5,4,3]
    torch.testing.assert_close(g_soft.sum(-1), torch.ones(2, 5, 4))
    assert not torch.allclose(g_sig.sum(-1), torch.ones(2, 5, 4), atol=1e-2)
    logits = torch.log(g_sig / (1 - g_sig))  # the same logits, recovered from the sigmoid
    torch.testing.assert_close(g_soft, torch.softmax(logits, -1), rtol=1e-5, atol=1e-6)


def _gate_logits(gate, x):
    return gate.fc2(torch.nn.functional.silu(gate.fc1(x))).view(*x.shape[:-1], gate.n_heads, 3)


def test_the_gate_spread_penalty_adds_its_gradient_and_leaves_the_gates_alone():
    from nsa.model.attention import GateMLP
    torch.manual_seed(0)
    plain, penalised = GateMLP(16, 8, 4, "softmax"), GateMLP(16, 8, 4, "softmax", spread_penalty=0.3)
    penalised.load_state_dict(plain.state_dict())
    x, target = torch.randn(2, 5, 16), torch.rand(2, 5, 4, 3)
    g = penalised(x)
    assert torch.equal(g, plain(x))  # the forward is untouched
    ((g - target) ** 2).sum().backward()
    z = _gate_logits(plain, x)
    penalty = 0.3 * ((z - z.mean(-1, keepdim=True)) ** 2).sum(-1).mean()  # the same, spelled out in the loss
    (((plain(x) - target) ** 2).sum() + penalty).backward()
    for a, b in zip(penalised.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_gate_floor_acts_on_a_collapsed_branch_only():
    from nsa.model.attention import GateMLP
    torch.manual_seed(0)
    plain, floored = GateMLP(16, 0, 4, "softmax"), GateMLP(16, 0, 4, "softmax", floor=0.02)  # linear: z = fc2(x)
    floored.load_state_dict(plain.state_dict())
    x, target = torch.cat([torch.ones(2, 5, 1), torch.randn(2, 5, 15)], -1), torch.rand(2, 5, 4, 3)

    def grads(gate, extra=lambda g: 0.0):
        gate.zero_grad()
        g = gate(x)
        (((g - target) ** 2).sum() + extra(g)).backward()
        return gate.fc2.weight.grad.clone()

    with torch.no_grad():  # head 1 routes: branch 2 gets ~0 at the tokens with x[..., 1] < 0, half at the others
        for gate in (plain, floored):
            gate.fc2.weight.view(4, 3, 16)[1, 2, 1] = 40.0
    shares = plain(x)
    assert (shares < 0.02).any() and (shares.mean(dim=(0, 1)) > 0.02).all()
    assert torch.equal(grads(floored), grads(plain))  # no mean share under the floor: exactly the loss's gradient
    with torch.no_grad():
        for gate in (plain, floored):
            gate.fc2.weight.view(4, 3, 16)[0, 1, 0] = -10.0  # head 0's branch 1 collapsed, for every token
    means = plain(x).mean(dim=(0, 1))
    assert means[0, 1] < 0.02 and (means[1:] > 0.02).all() and (means[:, [0, 2]] > 0.02).all()
    # The floor's term spelled out in the loss: -log of each (head, branch) share averaged over the tokens that is
    # under 0.02, averaged over the 4 heads.
    def floor_term(g):
        means = g.mean(dim=(0, 1))
        return -(torch.log(means) * (means.detach() < 0.02)).sum() / 4

    spelled = grads(plain, floor_term)
    torch.testing.assert_close(grads(floored), spelled)
    assert not torch.allclose(grads(floored), grads(plain))


@pytest.mark.parametrize("pull", [{"spread_penalty": 1.0}, {"floor": 0.02}], ids=["spread", "floor"])
def test_a_gate_pull_revives_a_collapsed_branch(pull):
    # A branch whose logit sits far below the others has a share near zero and, from the loss, a gradient near
    # zero: it stays collapsed. The pull alone brings it back.
    from nsa.model.attention import GateMLP

    def share_after_steps(pulled: bool) -> float:
        torch.manual_seed(1)
        gate = GateMLP(16, 0, 4, "softmax", **(pull if pulled else {}))  # a linear gate: the logits are fc2(x)
        x = torch.cat([torch.ones(64, 1), 0.1 * torch.randn(64, 15)], 1)  # feature 0 is constant
        with torch.no_grad():
            gate.fc2.weight.view(4, 3, 16)[:, 0, 0] = -8.0  # branch 0 of every head collapsed, for every input
        opt = torch.optim.Adam(gate.parameters(), lr=0.05)
        for _ in range(100):
            opt.zero_grad()
            (gate(x).sum() * 0.0).backward()  # a loss indifferent to the gates: only the pull moves them
            opt.step()
        return gate(x)[..., 0].mean(0).min().item()  # the lowest head's share of branch 0, over the inputs

    assert share_after_steps(False) < 0.001 and share_after_steps(True) > 0.01


def test_the_gate_spread_penalty_is_checked():
    from nsa.errors import ConfigError
    from nsa.model.config import ModelConfig, NSAParams
    with pytest.raises(ConfigError, match="gate_spread_penalty needs softmax gates"):
        ModelConfig(nsa=NSAParams(gate_spread_penalty=0.1)).validate()
    with pytest.raises(ConfigError, match="must be >= 0"):
        ModelConfig(nsa=NSAParams(gate="softmax", gate_spread_penalty=-1.0)).validate()
    with pytest.raises(ConfigError, match="gate_floor needs softmax gates"):
        ModelConfig(nsa=NSAParams(gate_floor=0.02)).validate()
    with pytest.raises(ConfigError, match=r"gate_floor must be in \[0, 1/3\)"):
        ModelConfig(nsa=NSAParams(gate="softmax", gate_floor=0.4)).validate()
    ModelConfig(nsa=NSAParams(gate="softmax", gate_floor=0.02)).validate()
