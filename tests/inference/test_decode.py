"""Cached decoding (nsa.inference): decode equals the full forward, the compressed stream, reads,
the selection, generation, and `nsa generate` from a trained checkpoint."""

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa.cli import main
from nsa.config import load_config
from nsa.errors import UserError
from nsa.inference import decode_attention, decode_step, dense_decode_attention, new_cache, prefill
from nsa.inference.generate import generate, generate_text, generate_uncached, load_for_inference
from nsa.model import ModelConfig, NSAParams, Transformer
from nsa.ops import reference
from nsa.ops.geometry import num_compressed_blocks
from nsa.train.loop import train

generate_module = importlib.import_module("nsa.inference.generate")  # the package's `generate` is the function

# Small enough that every branch is sparse at T: 4 of 13 selection blocks, a 16-token window.
HYPER = dict(block_len=8, block_stride=4, sel_block=8, n_sel=4, window=16)
T = 101
VOCAB = 61


def tiny_model(attention="nsa", seed=0, **nsa_changes) -> Transformer:
    cfg = ModelConfig(
        attention=attention, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64,
        nsa=NSAParams(**{"phi_hidden": 16, "gate_hidden": 16, **HYPER, **nsa_changes}, backend="reference"),
    )
    torch.manual_seed(seed)
    model = Transformer(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random everywhere, phi's zero-initialised last layer included, so every path carries signal.
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def tokens_for(batch, length, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, tokens, prompt_len, record=None):
    """Logits [B, T-prompt_len+1, V] at positions prompt_len-1 .. T-1: prefill, then one step per token."""
    cache = new_cache(model, tokens.shape[0], tokens.shape[1])
    out = [prefill(model, tokens[:, :prompt_len], cache)]
    for t in range(prompt_len, tokens.shape[1]):
        out.append(decode_step(model, tokens[:, t], cache))
        if record is not None:
            record(t, cache)
    return torch.stack(out, 1), cache


@torch.no_grad()
def full_forward_layers(model, tokens):
    """Full-forward logits and, per layer, its queries and compressed keys/values."""
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args)) for b in model.layers]
    try:
        logits = model(tokens)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for block, (x, cos, sin) in zip(model.layers, inputs):
        p = block.attn.project(x, cos, sin)
        layers.append({"q": p["q"], "k_cmp": block.attn.compress_k(p["k_cmp"]),
                       "v_cmp": block.attn.compress_v(p["v_cmp"])})
    return logits, layers


@pytest.mark.parametrize(
    "attention,prompt_len,changes",
    [
        ("nsa", 1, {}),
        ("nsa", 13, {}),
        ("nsa", 37, {"shared_kv": True}),
        ("nsa", 13, {"phi": "mean"}),
        ("nsa", 13, {"gate_hidden": 0}),
        ("nsa", 13, {"gate": "softmax"}),
        ("dense", 1, {}),
        ("dense", 29, {}),
    ],
)
def test_prefill_then_decode_equals_the_full_forward_at_every_position(attention, prompt_len, changes):
    model = tiny_model(attention, **changes)
    tokens = tokens_for(2, T)
    got, _ = decode_logits(model, tokens, prompt_len)
    with torch.no_grad():
        want = model(tokens)[:, prompt_len - 1:]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm, self.bmm_shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.mm += 1
        elif func is torch.ops.aten.bmm.default:
            self.bmm_shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention,gate_hidden,mm_per_layer,prep_kernel",
                         [("nsa", 16, 4, False), ("nsa", 0, 4, False), ("nsa", 16, 4, True), ("nsa", 0, 4, True),
                          ("dense", 16, 4, False)],
                         ids=["nsa", "nsa-linear-gate", "nsa-prep-kernel", "nsa-linear-gate-prep-kernel", "dense"])
def test_a_decode_step_fuses_the_input_maps_and_phi_into_few_matmuls(attention, gate_hidden, mm_per_layer,
                                                                     prep_kernel, monkeypatch):
    """At decode batch sizes the count of matmuls sets the time: one for the layer input's maps (queries,
    keys/values, the gate's first layer), then wo and the MLP's two (an MLP gate's second layer is a product
    and a sum, which torch.compile fuses with its SiLU and sigmoid, or the decode prep kernel computes with
    RoPE and the cache write: nsa.ops.triton.decode_prep); phi's MLP is two batched matmuls over keys
    and values together, only on a step that completes a compressed block. One more for the output head."""
    model = tiny_model(attention, gate_hidden=gate_hidden)
    device = "cpu"
    if prep_kernel:  # the Triton prep: on the GPU, or in the interpreter without one (float32: float64 is PyTorch's)
        import nsa.ops.triton.decode_prep as prep_module

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.float().to(device)
        launches = []
        prep = prep_module.decode_prep
        monkeypatch.setattr("nsa.inference.decode._prep_on_triton", lambda backend, x: True)
        monkeypatch.setattr(prep_module, "decode_prep", lambda *a, **kw: launches.append(1) or prep(*a, **kw))
    tokens = tokens_for(2, 41).to(device)
    cache = new_cache(model, 2, 41)
    prefill(model, tokens[:, :39], cache)
    for t in (39, 40):  # t = 39 completes a compressed block ((39 + 1 - l) % d == 0), t = 40 does not
        with _CountMatmuls() as count:
            decode_step(model, tokens[:, t], cache)
        assert count.mm == mm_per_layer * 2 + 1
        phi = [s for s in count.bmm_shapes if s in ((2, 8 * 8, 16), (2, 16, 8))]  # [2, l*D, hidden], [2, hidden, D]
        assert phi == ([(2, 64, 16), (2, 16, 8)] * 2 if attention == "nsa" and t == 39 else [])
    assert not prep_kernel or len(launches) == 2 * 2  # both steps of both layers went through the kernel


# Prompts of one token, shorter than a compressed block (l = 8), of one block exactly, between blocks and
# across selection blocks (l' = 8).
RAGGED = [1, 5, 8, 37, 50]


def packed(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts back to back, tokens [1, total], and their boundaries cu_seqlens [B+1]."""
    lengths = torch.tensor([0] + [len(p) for p in prompts])
    return torch.cat(prompts)[None], lengths.cumsum(0).to(torch.int32)


def packed_then_decoded(model, seqs, lengths, steps):
    """Logits [B, steps+1, V]: one packed prefill of seqs[b, :lengths[b]], then `steps` steps of every sequence,
    each at its own position; and the cache."""
    cache = new_cache(model, len(lengths), max(lengths) + steps)
    tokens, cu_seqlens = packed([s[:n] for s, n in zip(seqs, lengths)])
    got = [prefill(model, tokens, cache, cu_seqlens)]
    positions = torch.tensor(lengths)
    for k in range(steps):
        got.append(decode_step(model, seqs[torch.arange(len(lengths)), positions + k], cache))
    return torch.stack(got, 1), cache


@pytest.mark.parametrize("attention,changes", [("nsa", {}), ("nsa", {"shared_kv": True}), ("dense", {})])
@pytest.mark.parametrize("prefill_tokens", [None, 60], ids=["one-forward", "a-few-prompts-a-forward"])
def test_packed_prompts_of_different_lengths_decode_like_each_alone(attention, changes, prefill_tokens, monkeypatch):
    """Each decoded step's logits equal the full forward of that sequence alone (no padding, nothing shared)."""
    if prefill_tokens:  # runs of prompts of at most 60 tokens: [1, 5, 8, 37], then [50], each its own forward
        monkeypatch.setattr("nsa.inference.decode.PREFILL_TOKENS", prefill_tokens)
    model = tiny_model(attention, seed=3, **changes)
    seqs = tokens_for(len(RAGGED), 80, seed=2)
    got, _ = packed_then_decoded(model, seqs, RAGGED, 20)
    for b, n in enumerate(RAGGED):
        with torch.no_grad():
            alone = model(seqs[b: b + 1, : n + 20])[0]
        torch.testing.assert_close(got[b], alone[n - 1:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_packed_prefill_fills_each_sequence_as_its_prefill_alone(attention):
    """The packed prefill's last logits are each prompt's own, and each sequence's cache (raw keys and values,
    compressed tokens, their count) holds what a cached prefill of that prompt alone holds, so every step after
    it matches the single-sequence cached decode."""
    model = tiny_model(attention, seed=4)
    seqs = tokens_for(len(RAGGED), 70, seed=5)
    got, cache = packed_then_decoded(model, seqs, RAGGED, 12)
    for b, n in enumerate(RAGGED):
        alone, alone_cache = decode_logits(model, seqs[b: b + 1, : n + 12], n)
        torch.testing.assert_close(got[b], alone[0], rtol=1e-10, atol=1e-10)
        assert cache.host_lengths[b] == alone_cache.host_lengths[0] == n + 12
        for mine, theirs in zip(cache.layers, alone_cache.layers):
            held = n + 12
            torch.testing.assert_close(mine.k[..., b, :held, :, :], theirs.k[..., 0, :held, :, :], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mine.v[..., b, :held, :, :], theirs.v[..., 0, :held, :, :], rtol=1e-12, atol=1e-12)
            if attention == "nsa":
                nc = num_compressed_blocks(held, HYPER["block_len"], HYPER["block_stride"])
                assert mine.n_cmp[b].item() == theirs.n_cmp[0].item() == nc
                torch.testing.assert_close(mine.k_cmp[b, :nc], theirs.k_cmp[0, :nc], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(mine.v_cmp[b, :nc], theirs.v_cmp[0, :nc], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_the_packed_prefill_compresses_each_prompt_inside_itself(attention):
    """Right after a packed prefill, sequence b holds Nc(L_b) compressed tokens equal to its full forward's, and
    the last logits equal each prompt's own forward at its last token (no step taken)."""
    model = tiny_model(attention, seed=8)
    prompts = [tokens_for(1, n, seed=20 + n)[0] for n in RAGGED]
    cache = new_cache(model, len(RAGGED), max(RAGGED))
    tokens, cu_seqlens = packed(prompts)
    last = prefill(model, tokens, cache, cu_seqlens)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            want, layers = full_forward_layers(model, prompt[None]) if attention == "nsa" else (model(prompt[None]), [])
        torch.testing.assert_close(last[b], want[0, -1], rtol=1e-10, atol=1e-10)
        for layer_cache, full in zip(cache.layers, layers):
            nc = full["k_cmp"].shape[1]
            assert layer_cache.n_cmp[b].item() == nc
            torch.testing.assert_close(layer_cache.k_cmp[b, :nc], full["k_cmp"][0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer_cache.v_cmp[b, :nc], full["v_cmp"][0], rtol=1e-12, atol=1e-12)
    assert cache.lengths.tolist() == cache.host_lengths == RAGGED


@pytest.mark.parametrize("cu_seqlens,message", [
    ([0, 3, 3, 10], "do not fit"),  # an empty prompt
    ([0, 3, 10], "do not fit"),  # two prompts for a cache of three sequences
    ([0, 3, 6, 9], "from 0 to total"),  # boundaries that miss the last token
    ([1, 3, 6, 10], "from 0 to total"),
])
def test_packed_prompts_that_do_not_fit_the_cache_are_refused(cu_seqlens, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        prefill(model, tokens_for(1, 10), new_cache(model, 3, 8), torch.tensor(cu_seqlens, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit"):  # a prompt longer than the cache
        prefill(model, tokens_for(1, 10), new_cache(model, 2, 6), torch.tensor([0, 1, 10], dtype=torch.int32))


def test_the_compressed_stream_is_emitted_on_schedule_and_equals_the_full_compressor():
    model = tiny_model(seed=5)
    tokens = tokens_for(2, T, seed=4)
    prompt_len = 13
    counts = []
    _, cache = decode_logits(model, tokens, prompt_len,
                             record=lambda t, c: counts.append((t, [layer.n_cmp.tolist() for layer in c.layers])))
    l, d = HYPER["block_len"], HYPER["block_stride"]
    before = [[[2, 2]] * 2] + [c for _, c in counts[:-1]]  # Nc(13) = 2 blocks came with the prompt
    emitted = [t for (t, after), prev in zip(counts, before) if after != prev]
    assert emitted == [t for t in range(prompt_len, T) if t + 1 >= l and (t + 1 - l) % d == 0]
    assert emitted[:3] == [15, 19, 23]
    assert all(after == [[num_compressed_blocks(t + 1, l, d)] * 2] * 2 for t, after in counts)
    _, layers = full_forward_layers(model, tokens)
    for layer_cache, full in zip(cache.layers, layers):
        nc = full["k_cmp"].shape[1]
        assert nc == num_compressed_blocks(T, l, d) == 24
        torch.testing.assert_close(layer_cache.k_cmp[:, :nc], full["k_cmp"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer_cache.v_cmp[:, :nc], full["v_cmp"], rtol=1e-12, atol=1e-12)


def _real_tokens_in(blocks, t, sel_block):
    return sum(1 for j in blocks if j >= 0 for s in range(j * sel_block, (j + 1) * sel_block) if s <= t)


@pytest.mark.parametrize("shared_kv", [False, True])
def test_each_step_selects_the_reference_blocks_and_reads_what_the_design_says(shared_kv):
    model = tiny_model(seed=7, shared_kv=shared_kv)
    tokens = tokens_for(2, T, seed=6)
    steps = []
    decode_logits(model, tokens, 1, record=lambda t, c: steps.append(
        (t, [(layer.selected.clone(), layer.reads.clone()) for layer in c.layers])))
    _, layers = full_forward_layers(model, tokens)
    sel = {k: HYPER[k] for k in ("block_len", "block_stride", "sel_block", "n_sel")}
    ref = [reference.select_blocks(full["q"], full["k_cmp"], **sel) for full in layers]  # [B,T,G,n]
    l, d, l_sel, w = HYPER["block_len"], HYPER["block_stride"], HYPER["sel_block"], HYPER["window"]
    free_choices = set()
    for t, per_layer in steps:
        for i, (selected, reads) in enumerate(per_layer):
            assert torch.equal(selected, ref[i][:, t]), (t, i, selected, ref[i][:, t])
            for b in range(2):
                for g in range(2):
                    blocks = selected[b, g].tolist()
                    want = num_compressed_blocks(t + 1, l, d) + _real_tokens_in(blocks, t, l_sel) + min(w, t + 1)
                    assert reads[b, g].item() == want, (t, i, b, g, blocks, reads[b, g].item(), want)
                    j_t = t // l_sel
                    free_choices |= set(blocks) - {-1, 0, j_t, j_t - 1}
    # The scores matter: free picks other than block 1 (where ties, e.g. all-zero scores, would land).
    assert len(free_choices - {1}) >= 3, free_choices
    assert steps[-1][1][0][1].max().item() == 24 + 29 + 16 < T  # sparse: 69 of the 101 tokens


@pytest.mark.parametrize("n_sel,t,want", [(4, 38, [0, 1, 3, 4]), (4, 70, [0, 1, 7, 8]), (6, 67, [0, 1, 2, 3, 7, 8])])
def test_tied_scores_go_to_the_lower_block_as_in_the_reference(n_sel, t, want):
    # q = 0 makes p_cmp uniform; where Nc(t+1) is a power of two, p and the block scores are exact,
    # so every fully covered block ties with the others.
    model = tiny_model(seed=17, n_sel=n_sel)
    _, cache = decode_logits(model, tokens_for(1, T, seed=8), T)
    layer = cache.layers[0]
    nc = num_compressed_blocks(t + 1, HYPER["block_len"], HYPER["block_stride"])
    assert nc & (nc - 1) == 0
    layer.n_cmp.fill_(nc)
    q = torch.zeros(1, 4, 8, dtype=torch.float64)
    decode_attention(q, torch.rand(1, 4, 3, dtype=torch.float64), layer, t)
    sel = {k: HYPER[k] for k in ("block_len", "block_stride", "sel_block")}
    ref = reference.select_blocks(torch.zeros(1, t + 1, 4, 8, dtype=torch.float64), layer.k_cmp[:, :nc], **sel,
                                  n_sel=n_sel)
    assert layer.selected.tolist() == ref[:, t].tolist() == [[want] * 2]


def test_dense_reads_every_cached_token():
    model = tiny_model("dense")
    reads = []
    decode_logits(model, tokens_for(1, 40), 5, record=lambda t, c: reads.append(c.layers[1].reads.tolist()))
    assert reads == [[[t + 1] * 2] for t in range(5, 40)]


def test_the_cache_refuses_to_overflow_and_prompts_must_fit():
    model = tiny_model()
    cache = new_cache(model, 1, 10)
    with pytest.raises(ValueError, match="do not fit"):
        prefill(model, tokens_for(1, 11), cache)
    prefill(model, tokens_for(1, 9), cache)
    decode_step(model, torch.tensor([3]), cache)
    with pytest.raises(ValueError, match="cache is full"):
        decode_step(model, torch.tensor([3]), cache)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_greedy_generation_equals_argmax_of_full_forwards(attention):
    model = tiny_model(attention, seed=11)
    prompt = tokens_for(2, 7, seed=12)
    want = generate_uncached(model, prompt, 40, context=1000, temperature=0)
    assert generate(model, prompt, 40, temperature=0) == want
    assert generate(model, prompt[0].tolist(), 40, temperature=0) == want[:1]
    # top-k 1 and a vanishing top-p keep only the likeliest token: sampling reduces to greedy.
    assert generate(model, prompt, 40, temperature=1.0, top_k=1, seed=0) == want
    assert generate(model, prompt, 40, temperature=1.0, top_p=1e-9, seed=0) == want


def test_the_dense_models_split_decode_kernel_generates_the_full_forwards_argmax(monkeypatch):
    # The dense decode step on nsa.ops.triton.dense_decode (the CUDA default; Triton's interpreter here) with
    # 64-token splits: a ragged batch whose contexts end in the first, second and third split.
    import functools

    import nsa.inference.decode as decode_module
    from nsa.ops.tuning import TUNING

    kernel_calls = []
    triton_decode = functools.partial(dense_decode_attention, backend="triton")
    monkeypatch.setattr(decode_module, "dense_decode_attention",
                        lambda *a, **k: kernel_calls.append(1) or triton_decode(*a, **k))
    monkeypatch.setattr(TUNING, "dense_decode_split", 64)
    # On a GPU machine Triton has no interpreter: the kernel runs there, on a float32 copy of the model moved to the
    # GPU (the kernel computes in float32; the ragged prefill attends per document through SDPA: head dim 8 is under
    # FlexAttention's minimum). The full forwards stay on the CPU, in float64.
    model = tiny_model("dense", seed=17)
    on_kernel = copy.deepcopy(model).to("cuda", torch.float32) if torch.cuda.is_available() else model
    prompts = [tokens_for(1, n, seed=n)[0].tolist() for n in (40, 70, 130)]
    got = generate(on_kernel, prompts, 10, temperature=0)
    assert len(kernel_calls) == 9 * model.cfg.n_layers  # every decoded token after the prefill's
    assert got == [generate_uncached(model, [p], 10, context=1000, temperature=0)[0] for p in prompts]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the float64 fallback is the GPU's (the interpreter takes it)")
def test_a_float64_model_decodes_on_the_gpu_through_pytorch_and_the_kernel_names_its_dtypes():
    model = tiny_model("dense", seed=18)
    on_gpu = copy.deepcopy(model).cuda()
    prompts = [tokens_for(1, n, seed=n)[0].tolist() for n in (5, 30)]
    assert generate(on_gpu, prompts, 6, temperature=0) == generate(model, prompts, 6, temperature=0)
    cache = new_cache(on_gpu, 1, 8).layers[0]
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        dense_decode_attention(torch.zeros(1, 4, 8, dtype=torch.float64, device="cuda"), cache, 0, backend="triton")


@pytest.mark.parametrize("prompt_len,new_tokens", [(1, 3), (2, 5), (2, 6), (3, 10)])
def test_contexts_shorter_than_one_compressed_block_generate_the_full_forwards_argmax(prompt_len, new_tokens):
    # The cache holds prompt_len + new_tokens - 1 <= block_len tokens: at most one compressed slot, or none at all.
    model = tiny_model(seed=15)
    prompt = tokens_for(2, prompt_len, seed=16)
    want = generate_uncached(model, prompt, new_tokens, context=1000, temperature=0)
    assert generate(model, prompt, new_tokens, temperature=0) == want


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_a_ragged_batch_generates_what_each_prompt_generates_alone(attention, monkeypatch):
    prefills = []
    real_prefill = generate_module.prefill
    monkeypatch.setattr(generate_module, "prefill", lambda *args: prefills.append(args) or real_prefill(*args))
    model = tiny_model(attention, seed=14)
    prompts = [tokens_for(1, n, seed=n)[0].tolist() for n in (3, 20, 1, 9)]
    together = generate(model, prompts, 12, temperature=0)
    _, tokens, _, cu_seqlens = prefills[0]  # one packed prefill, no padding
    assert len(prefills) == 1 and tokens.shape == (1, 33) and cu_seqlens.tolist() == [0, 3, 23, 24, 33]
    assert together == [generate_uncached(model, [p], 12, context=1000, temperature=0)[0] for p in prompts]


def test_sampling_is_seeded_and_streams_every_token():
    model = tiny_model(seed=13)
    streamed = []
    first = generate(model, [1, 2, 3], 30, temperature=1.0, top_p=0.9, top_k=20, seed=4,
                     on_token=lambda tok: streamed.append(tok.tolist()))
    assert first == generate(model, [1, 2, 3], 30, temperature=1.0, top_p=0.9, top_k=20, seed=4)
    assert first != generate(model, [1, 2, 3], 30, temperature=1.0, top_p=0.9, top_k=20, seed=5)
    assert [[tok] for tok in first[0]] == streamed
    stopped = generate(model, [1, 2, 3], 30, temperature=1.0, top_p=0.9, top_k=20, seed=4, stop_id=first[0][5])
    assert stopped[0] == first[0][: first[0].index(first[0][5]) + 1]


# ---------------------------------------------------------------- from a trained checkpoint, through the CLI

FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=64", "train.batch_size=8", "train.steps=5", "train.warmup_steps=2",
    "train.eval_every=0", "train.log_every=5", "train.sample_tokens=0", "train.progress=false",
]
PROMPT = "And God said"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    train(load_config(None, FAST + [f"train.out_dir={out}", "train.run_name=r"]))
    return out / "r"


def test_nsa_generate_streams_the_greedy_continuation_of_a_trained_checkpoint(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "24",
                 "--temperature", "0", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out

    loaded = load_for_inference(run_dir, "cpu")
    assert loaded.path.name == "step_00000005" and loaded.context == 64
    prompt = torch.as_tensor(loaded.tokenizer.encode(PROMPT))[None]
    ids = generate_uncached(loaded.model, prompt, 24, context=64, temperature=0)[0]
    if loaded.tokenizer.eot_id in ids:
        ids = ids[: ids.index(loaded.tokenizer.eot_id)]
    continuation = loaded.tokenizer.decode(ids)
    assert printed == PROMPT + continuation + "\n"

    pieces = []
    assert generate_text(loaded.model, loaded.tokenizer, PROMPT, 24, context=loaded.context, temperature=0,
                         write=pieces.append) == continuation
    assert pieces[0] == PROMPT and "".join(pieces) == printed and len(pieces) > 2  # streamed piece by piece
    # Full forwards (the trainer's end-of-run sample) write the same greedy text.
    assert generate_text(loaded.model, loaded.tokenizer, PROMPT, 24, context=loaded.context, temperature=0,
                         write=lambda piece: None, cached=False) == continuation


def test_nsa_generate_continues_a_two_token_prompt(run_dir, capsys):
    # "hi" plus 5 new tokens fill fewer tokens than one compressed block (16) of the trained model.
    assert main(["generate", str(run_dir), "--prompt", "hi", "--max-new-tokens", "5", "--temperature", "0",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    loaded = load_for_inference(run_dir, "cpu")
    prompt = torch.as_tensor(loaded.tokenizer.encode("hi"))[None]
    assert prompt.shape[1] + 5 <= loaded.model.cfg.nsa.block_len
    ids = generate_uncached(loaded.model, prompt, 5, context=64, temperature=0)[0]
    if loaded.tokenizer.eot_id in ids:
        ids = ids[: ids.index(loaded.tokenizer.eot_id)]
    assert printed == "hi" + loaded.tokenizer.decode(ids) + "\n"


def test_nsa_generate_continues_several_prompts_together_as_each_alone(run_dir, capsys):
    # Prompts of different lengths ("hi" is shorter than one compressed block), one packed prefill.
    prompts = [PROMPT, "hi", "In the beginning God created the heaven"]
    alone = []
    for prompt in prompts:
        assert main(["generate", str(run_dir), "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "0",
                     "--device", "cpu"]) == 0
        alone.append(capsys.readouterr().out.rstrip("\n"))
    args = ["generate", str(run_dir), "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu"]
    assert main(args + [arg for prompt in prompts for arg in ("--prompt", prompt)]) == 0
    assert capsys.readouterr().out == "\n\n".join(alone) + "\n"
    assert len(set(alone)) == 3 and all(text.startswith(prompt) for text, prompt in zip(alone, prompts))


def test_nsa_generate_compiled_writes_the_same_greedy_text(run_dir, capsys, monkeypatch):
    # --compile hands the decode step's body to torch.compile once, and that compiled body takes every decode step.
    # torch.compile is a stand-in here that counts the calls of what it returns: that a real compile of this body
    # gives the eager step's logits is test_the_compiled_decode_step_gives_the_eager_steps_logits's.
    from nsa.inference.decode import step_logits

    compiled, calls = [], []

    def stand_in(fn, **kw):
        compiled.append((fn, kw))
        return lambda *a, **k: calls.append(1) or fn(*a, **k)

    monkeypatch.setattr(torch, "compile", stand_in)
    args = ["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu"]
    assert main(args) == 0 and not compiled
    eager = capsys.readouterr().out
    assert main(args + ["--compile"]) == 0 and compiled == [(step_logits, {"dynamic": False})]
    text = capsys.readouterr().out
    assert text == eager and len(eager) > len(PROMPT) + 1
    assert len(calls) == 11  # every step after the prefill's token went through the compiled body (no stop token)


def test_nsa_generate_samples_with_a_seed(run_dir, capsys):
    args = ["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "20", "--temperature", "0.9",
            "--top-p", "0.9", "--top-k", "40", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith(PROMPT) and len(first) > len(PROMPT) + 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["/no/such/run"], "nsa: error: no complete checkpoint at '/no/such/run'"),
        (["RUN", "--prompt", "x" * 65], "nsa: error: the prompt is 65 tokens but the context is 64"),
        (["RUN", "--prompt", "x" * 10, "--max-new-tokens", "60"], "nsa: error: the prompt (10 tokens) plus"),
        (["RUN", "--max-new-tokens", "0"], "nsa: error: --max-new-tokens must be >= 1"),
        (["RUN", "--top-p", "1.5"], "nsa: error: top_p must be in (0, 1]"),
        (["RUN", "--top-p", "nan"], "nsa: error: top_p must be in (0, 1]"),
        (["RUN", "--temperature", "nan"], "nsa: error: temperature must be a finite number >= 0"),
        (["RUN", "--temperature", "inf"], "nsa: error: temperature must be a finite number >= 0"),
    ],
)
def test_nsa_generate_user_errors_are_one_line_with_exit_code_2(run_dir, args, message, capsys):
    args = [str(run_dir) if a == "RUN" else a for a in args]
    assert main(["generate"] + args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""


def test_empty_prompts_are_refused():
    with pytest.raises(UserError, match="at least one token"):
        generate(tiny_model(), [], 3)


@pytest.fixture(params=["cpu", "cuda-triton"])
def step_device(request, monkeypatch):
    """Where the decode step runs: on the CPU in PyTorch, or on a GPU with the NSA layers' Triton decode (the decode
    prep kernel and the decode attention, user-defined Triton kernels inside the compiled step)."""
    if request.param == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    monkeypatch.setattr("nsa.inference.decode._step_backend", lambda attn: "triton")
    return "cuda"


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_the_compiled_decode_step_gives_the_eager_steps_logits(attention, step_device):
    """The compiled step's logits are the eager step's. And no kernel of the compiled NSA step may sweep the raw
    caches' token dimension: a write through a view of a cache (cache.k[s][rows, t] = ...) compiles to a scatter
    that copies the whole cache every step (on an H100 at 64k: 5.6 ms a token instead of 3, 55 ms at batch 16). On
    a GPU the same for the Triton decode prep kernel's write: a functionalized mutation that Inductor could not put
    back in place would copy the cache (a kernel of the cache's size)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from nsa.inference import compiled_decode_step

    capacity = 4099  # prime: a loop over the token dimension shows as a size divisible by it
    model = tiny_model(attention).float().to(step_device)
    tokens = tokens_for(2, 40).to(step_device)
    caches = [new_cache(model, 2, capacity) for _ in range(2)]
    for cache in caches:
        prefill(model, tokens[:, :30], cache)
    step = compiled_decode_step(model)
    code = []
    for t in range(30, 40):  # crosses compressed emissions and a selection-block edge
        want = decode_step(model, tokens[:, t], caches[0])
        got, compiled = run_and_get_code(step, tokens[:, t], caches[1])  # the code of the compiles this step made
        code += compiled
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(caches[0].lengths, caches[1].lengths) and caches[1].longest == 40
    if attention == "nsa":  # dense attention reads the whole cache: its loops run over the token dimension
        pattern = r"(?:x\d+\s*<\s*(?:static_cast<int64_t>\()?|numel\s*=\s*)(\d+)"
        sizes = [int(n) for src in code for n in re.findall(pattern, src)]
        assert sizes, "no loop bounds found in the generated code"
        assert not [n for n in sizes if n % capacity == 0], "a kernel of the compiled step sweeps a whole cache"


def test_bench_decode_runs_on_cpu_and_reports_the_reads(tmp_path, capsys):
    import csv

    args = ["bench", "decode", "model.n_layers=1", "model.dim=64", "model.mlp_hidden=64", "model.vocab_size=97",
            "--contexts", "300", "--batches", "2", "--steps", "2", "--device", "cpu", "--out", str(tmp_path), "--profile"]
    assert main(args) == 0
    printed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed.count("nsa") == 2 and printed.count("dense") == 2  # each row as it lands, then the table
    for attention in ("nsa", "dense"):  # --profile: the step's ops by time (CPU time here), after the timed steps
        table = (tmp_path / f"profile_decode_{attention}_300_b2.txt").read_text()
        assert table.startswith("0 GPU kernels per call (mean over 5)") and "aten::mm" in table
    rows = {r["attention"]: r for r in csv.DictReader(open(tmp_path / "decode.csv"))}
    assert float(rows["dense"]["speedup"]) == 1.0 and float(rows["nsa"]["step_ms"]) > 0
    # After prefill (300 tokens), one cycle of d = 16 warm-up steps and the 2 timed steps rounded up to a
    # cycle, the last step sat at t = 331 (M7C's NSA geometry): Nc = (332 - 32) // 16 + 1 = 19 compressed
    # tokens, all 332 tokens in the 6 chosen blocks (16 allowed), and a 332-token window.
    assert float(rows["nsa"]["reads_per_group"]) == 19 + 332 + 332
    assert float(rows["dense"]["reads_per_group"]) == 332
    # The byte floor at the prompt's 300 tokens: NSA's layer reads (300 - 32) // 16 + 1 = 17 compressed tokens,
    # 300 in its blocks and a 300-token window; dense the 300 tokens; 2 sequences x 2 kv heads of 64 x keys and
    # values x 4 bytes (fp32).
    per_token = 2 * 2 * 64 * 2 * 4
    assert float(rows["nsa"]["layer_attention_mb"]) * 1e6 == pytest.approx((17 + 300 + 300) * per_token)
    assert float(rows["dense"]["layer_attention_mb"]) * 1e6 == pytest.approx(300 * per_token)
    for row in rows.values():
        assert 0 < float(row["step_floor_share"]) and 0 < float(row["attention_floor_share"])
        assert float(row["step_mb"]) > float(row["layer_attention_mb"]) and float(row["prefill_ms"]) > 0


def test_the_byte_floor_of_an_m7c_step_at_64k():
    """One M7C layer's NSA decode attention at 64k reads 4,095 compressed + 1,024 selected + 512 window positions
    of 2 kv heads (2.88 MB in bf16); a dense step reads ~626 MB at batch 1, NSA's ~282 MB."""
    import dataclasses

    from nsa.bench.byte_floor import attention_bytes, step_bytes
    from nsa.model import m7c

    cfg = dataclasses.replace(m7c(), vocab_size=50304)
    assert attention_bytes(cfg, 65536, 1, 2) == (4095 + 1024 + 512) * 2 * 2 * 64 * 2
    assert attention_bytes(dataclasses.replace(cfg, attention="dense"), 65536, 16, 2) == 16 * 65536 * 2 * 2 * 64 * 2
    with torch.device("meta"):
        nsa = Transformer(cfg).to(torch.bfloat16)
        dense = Transformer(dataclasses.replace(cfg, attention="dense")).to(torch.bfloat16)
    weights = sum(p.numel() for p in nsa.parameters()) * 2
    assert step_bytes(nsa, 65536, 1) == weights + 12 * attention_bytes(cfg, 65536, 1, 2)
    assert step_bytes(dense, 65536, 1) / 1e6 == pytest.approx(626, rel=0.01)
    assert step_bytes(nsa, 65536, 1) / 1e6 == pytest.approx(282, rel=0.01)


def test_bench_decode_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    # A GPU call's time limit or Ctrl-C during the second row: the first row is already in the CSV and JSON.
    import csv
    import json

    from nsa.bench import decode as bench_decode

    measured = []

    def measure_then_stop(*args, **kwargs):
        if measured:
            raise KeyboardInterrupt
        measured.append(bench_decode_measure(*args, **kwargs))
        return measured[-1]

    bench_decode_measure = bench_decode.measure
    monkeypatch.setattr(bench_decode, "measure", measure_then_stop)
    args = ["bench", "decode", "model.n_layers=1", "model.dim=64", "model.mlp_hidden=64", "model.vocab_size=97",
            "--contexts", "40", "--batches", "1", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main(args) == 130  # the CLI's exit status for Ctrl-C
    rows = list(csv.DictReader(open(tmp_path / "decode.csv")))
    assert [(r["attention"], r["context"]) for r in rows] == [("nsa", "40")] and float(rows[0]["step_ms"]) > 0
    assert rows[0]["speedup"] == ""  # its dense row never landed
    assert json.loads((tmp_path / "decode.json").read_text())["rows"][0]["step_ms"] == measured[0]["step_ms"]


def test_decoding_from_an_empty_cache_without_prefill_equals_the_full_forward():
    # The host's lengths start at 0 with the cache, so the steps that complete a block still emit it.
    model = tiny_model(seed=6)
    tokens = tokens_for(2, 20, seed=7)
    cache = new_cache(model, 2, 20)
    got = torch.stack([decode_step(model, tokens[:, t], cache) for t in range(20)], 1)
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens), rtol=1e-10, atol=1e-10)
    assert cache.layers[0].n_cmp.tolist() == [(20 - 8) // 4 + 1] * 2


def test_a_checkpoint_trained_with_a_pinned_dense_kernel_generates_where_that_kernel_is_missing(tmp_path):
    """model.dense_backend is the training machine's choice (e.g. cudnn on an H100): loading the checkpoint for
    inference on a CPU, which has no cuDNN attention, must still work, with SDPA's own choice."""
    from nsa.train import checkpoint

    train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.run_name=d", "model.attention=dense",
                                    "model.dense_backend=flash", "train.steps=2"]))
    path = checkpoint.resolve(tmp_path / "d")
    meta_file = path / checkpoint.COMPLETE
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["dense_backend"] = "cudnn"
    meta_file.write_text(json.dumps(meta))
    loaded = load_for_inference(tmp_path / "d", "cpu")
    assert loaded.model.layers[0].attn.backend == "auto"
    assert torch.isfinite(loaded.model(torch.arange(10)[None])).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode path at real shapes needs a GPU")
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_packed_prompts_decode_like_each_alone_on_the_gpu_in_bf16(attention):
    """The GPU path (Triton kernels, bf16, the M7C block geometry): one packed prefill of prompts from 1 token to
    past several selection blocks, then steps, gives each sequence's logits as its own cached decode alone."""
    cfg = ModelConfig(attention=attention, vocab_size=256, dim=256, n_layers=2, n_heads=12, n_kv_heads=2,
                      head_dim=64, mlp_hidden=512,
                      nsa=NSAParams(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda().to(torch.bfloat16).eval()
    lengths, steps = [1, 31, 700, 2049, 1500], 24
    seqs = torch.randint(0, 256, (len(lengths), max(lengths) + steps), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        got, _ = packed_then_decoded(model, seqs, lengths, steps)
        for b, n in enumerate(lengths):
            alone, _ = decode_logits(model, seqs[b: b + 1, : n + steps], n)
            torch.testing.assert_close(got[b].float(), alone[0].float(), rtol=3e-2, atol=6e-2)
