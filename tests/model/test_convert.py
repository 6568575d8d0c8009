"""nsa convert: a dense LlamaForCausalLM (random, built from a LlamaConfig) as an NSA checkpoint folder."""

import json

import pytest
import torch

from nsa.cli import main
from nsa.config import load_config
from nsa.convert import convert
from nsa.errors import UserError
from nsa.inference.generate import generate, load_for_inference
from nsa.model import Transformer
from nsa.train.init_from import load_initial_weights

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SEQ = 40
WINDOW = ["model.nsa.window=64", "model.nsa.block_len=8", "model.nsa.block_stride=4", "model.nsa.sel_block=8",
          "model.nsa.n_sel=4"]
WORDS = ["</s>", "the", "cat", "sat", "on", "mat", "a", "dog"] + [f"w{i}" for i in range(119)]


def llama_config(**changes):
    settings = dict(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=12, num_key_value_heads=2, head_dim=16, rope_theta=5e4, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=256)
    return transformers.LlamaConfig(**(settings | changes))


def save_tokenizer(folder):
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)} | {"[UNK]": len(WORDS)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(the dense model, its folder): 6 query heads per key/value head, random weights, a word tokenizer."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).float().eval()
    with torch.no_grad():  # norms away from 1, so that a norm left out would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("dense")
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model, folder


@pytest.fixture(scope="module")
def converted(dense, tmp_path_factory):
    return convert(dense[1], tmp_path_factory.mktemp("nsa") / "out", WINDOW)


def window_only(model):
    """Every gate fixed at (compressed 0, selected 0, window 1)."""
    for layer in model.layers:
        gate = layer.attn.gate
        gate.finish = lambda h, n=gate.n_heads: h.new_tensor([0.0, 0.0, 1.0]).expand(*h.shape[:-1], n, 3)
    return model


def test_converted_logits_equal_the_dense_models_with_the_window_gate_alone(dense, converted):
    model, _ = dense
    nsa = window_only(load_for_inference(converted, "cpu").model)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        got = nsa(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # The other branches and the initial gates (1/2 each) do change the output: the identity is the window's.
    with torch.no_grad():
        mixed = load_for_inference(converted, "cpu").model(tokens)
    assert (mixed - expected).abs().max() > 1e-2


def test_the_converted_checkpoint_starts_phi_at_the_mean_and_every_gate_at_one_half(converted):
    model = load_for_inference(converted, "cpu").model
    attn = model.layers[0].attn
    x = torch.randn(1, 3, attn.n_kv_heads, 8, attn.head_dim)  # [B, blocks, G, l, D]
    torch.testing.assert_close(attn.compress_k._pool(x), x.mean(dim=-2))
    gates = attn.gate(torch.randn(3, 5, model.cfg.dim))
    assert torch.equal(gates, torch.full_like(gates, 0.5))
    keys, values = attn.wkv.weight.view(3, 2, -1, model.cfg.dim).unbind(1)
    assert all(torch.equal(keys[0], k) and torch.equal(values[0], v) for k, v in zip(keys, values))


def test_the_config_follows_the_dense_one_and_the_tokenizer_comes_along(converted):
    cfg = json.loads((converted / "COMPLETE.json").read_text())["config"]
    m = cfg["model"]
    assert (m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["head_dim"], m["mlp_hidden"]) == (
        96, 2, 12, 2, 16, 160)
    assert (m["rope_theta"], m["norm_eps"], m["vocab_size"], m["nsa"]["window"]) == (5e4, 1e-5, 128, 64)
    assert (converted / "tokenizer.json").is_file() and cfg["data"]["tokenizer"] == "hf"
    assert cfg["train"]["seq_len"] == 256


def test_nsa_generate_runs_on_the_converted_folder(converted, capsys):
    assert main(["generate", str(converted), "--prompt", "the cat", "--max-new-tokens", "5", "--temperature", "0",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out.split()) > 2


def test_greedy_decoding_of_the_converted_model_follows_the_dense_model(dense, converted):
    model, _ = dense
    nsa = window_only(load_for_inference(converted, "cpu").model)
    prompt = [1, 2, 3, 4]
    got = generate(nsa, prompt, 6, temperature=0)[0]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert got == want


def test_model_init_from_loads_the_converted_weights_and_checks_shapes(converted):
    run = load_config(str(converted / "train.yaml"))
    assert run.model.init_from == str(converted.resolve())
    model = Transformer(run.model)
    load_initial_weights(run.model.init_from, model)
    reference = load_for_inference(converted, "cpu").model
    assert torch.equal(model.layers[1].attn.wkv.weight, reference.layers[1].attn.wkv.weight)
    other = Transformer(load_config(str(converted / "train.yaml"), ["model.mlp_hidden=96"]).model)
    with pytest.raises(UserError, match=r"model.init_from=.*'layers.0.mlp.w_gate_up.weight' has shape"):
        load_initial_weights(converted, other)


@pytest.mark.parametrize("changes, reason", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
    ({"attention_bias": True}, "attention_bias is true"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings false"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 5}, "model.n_heads"),
])
def test_configs_the_nsa_model_cannot_represent_are_refused(tmp_path, changes, reason):
    config = llama_config(**changes).to_dict() | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=reason):
        convert(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, reason", [("qwen2", "biases on their query/key/value"),
                                                ("qwen3", "q_norm/k_norm"), ("gpt2", "not a Llama one")])
def test_other_architectures_are_refused_with_the_reason(tmp_path, capsys, model_type, reason):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsa: error: ") and reason in err and err.count("\n") == 1


def test_nsa_convert_names_a_missing_folder_and_a_folder_without_config(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has no config.json" in err and err.count("\n") == 1


def test_nsa_convert_refuses_a_used_output_folder_and_foreign_overrides(dense, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["convert", str(dense[1]), str(tmp_path / "out")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["convert", str(dense[1]), str(tmp_path / "new"), "train.lr=1"]) == 2
    assert "only model.nsa.KEY=VALUE" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_nsa_train_starts_from_the_converted_weights_through_its_train_yaml(converted, tmp_path):
    assert main(["train", str(converted / "train.yaml"), "data.source=embedded", "train.steps=1",
                 "train.seq_len=64", "train.batch_size=1", "train.grad_accum=1", "train.lr=1e-12",
                 "train.warmup_steps=0", "train.eval_every=0", "train.sample_tokens=0", "train.progress=false",
                 "parallel.activation_checkpointing=false", f"train.out_dir={tmp_path}", "train.run_name=run",
                 "train.device=cpu"]) == 0
    trained = load_for_inference(tmp_path / "run", "cpu").model
    start = load_for_inference(converted, "cpu").model
    for name, weight in start.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[name], weight, rtol=1e-6, atol=1e-9, msg=name)


def test_weights_missing_from_the_dense_folder_are_named_in_one_line(dense, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = dense
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(UserError, match=r"lack the Llama weights of 'layers.1.attn.wkv.weight'"):
        convert(broken, tmp_path / "out", WINDOW)
