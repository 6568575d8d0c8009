"""Hugging Face interoperability: NSAForCausalLM round trips, padded batches, generate(), nsa export --format hf (NSA
and dense as LlamaForCausalLM, NSA loading without nsa imported), tokenizer files, exported folders in nsa generate /
eval, and model.init_from."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from nsa.cli import main  # noqa: E402
from nsa.config import load_config  # noqa: E402
from nsa.data.tokenizers import get_tokenizer  # noqa: E402
from nsa.errors import UserError  # noqa: E402
from nsa.hf.export import export_hf  # noqa: E402
from nsa.hf.folder import load_hf_folder  # noqa: E402
from nsa.hf.modeling import NSAConfig, NSAForCausalLM  # noqa: E402
from nsa.inference import generate, load_for_inference  # noqa: E402
from nsa.model.config import ModelConfig  # noqa: E402
from nsa.train import checkpoint  # noqa: E402
from nsa.train.loop import train  # noqa: E402
from nsa.typed_config import to_dict  # noqa: E402

RUN = ["model.dim=64", "model.n_layers=2", "model.mlp_hidden=96", "model.head_dim=16", "model.init_std=0.3",
       "train.seq_len=128", "train.batch_size=2", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0",
       "train.log_every=1", "train.sample_tokens=0", "train.progress=false"]
TEXT = "Ünïcødé — naïve café 東京 🙂 and plain ASCII.\nIn the beginning"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A short NSA run and a short dense run (byte tokenizer), each exported with --format hf."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for attention in ("nsa", "dense"):
        train(load_config(None, RUN + [f"model.attention={attention}", f"train.out_dir={root}",
                                       f"train.run_name={attention}"]))
        assert main(["export", str(root / attention), str(root / f"{attention}-hf"), "--format", "hf"]) == 0
        out[attention] = (root / attention, root / f"{attention}-hf")
    return out


def _prompt() -> torch.Tensor:
    return torch.tensor([[int(i) for i in get_tokenizer("byte").encode("And God said")]])


def test_import_nsa_registers_lazily():
    script = """
import sys
import nsa
assert "transformers" not in sys.modules and "torch" not in sys.modules
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("nsa")
assert type(AutoModelForCausalLM.from_config(config)).__name__ == "NSAForCausalLM"
"""
    subprocess.run([sys.executable, "-c", script], check=True)


def test_save_pretrained_round_trips_bit_for_bit(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(nsa=to_dict(ModelConfig(vocab_size=300, n_layers=2, init_std=0.3)),
                                     max_position_embeddings=256)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is NSAForCausalLM
    assert loaded.model.lm_head.weight is loaded.model.tok_emb.weight
    for (name, a), (other, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == other and torch.equal(a, b), name
    tokens = torch.randint(0, 300, (2, 150))
    assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def _padded(rows: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of rows padded to one length with token 0, on the left or on the right."""
    width = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def test_padded_batches_compute_each_row_alone():
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(nsa=to_dict(ModelConfig(vocab_size=300, n_layers=2, init_std=0.3)),
                                     max_position_embeddings=256)).eval()
    rows = [torch.randint(0, 300, (n,)) for n in (150, 70, 9)]
    with torch.no_grad():
        alone = [model(row[None]).logits[0] for row in rows]
        for left in (True, False):
            ids, mask = _padded(rows, left)
            logits = model(input_ids=ids, attention_mask=mask).logits
            for i, expected in enumerate(alone):
                torch.testing.assert_close(logits[i][mask[i].bool()], expected, rtol=1e-4, atol=1e-4)
            assert not logits[~mask.bool()].any()
        # Right padding without a mask (lm-evaluation-harness's loglikelihood batches): attention is causal.
        logits = model(_padded(rows, left=False)[0]).logits
        for i, expected in enumerate(alone):
            torch.testing.assert_close(logits[i, :len(rows[i])], expected, rtol=1e-4, atol=1e-4)
        ids, mask = _padded(rows, left=True)
        losses = [F.cross_entropy(a[:-1], row[1:], reduction="sum") for a, row in zip(alone, rows, strict=True)]
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(loss, sum(losses) / sum(len(row) - 1 for row in rows), rtol=1e-4, atol=1e-4)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        for i, row in enumerate(rows):
            single = model.generate(row[None], max_new_tokens=20, do_sample=False, eos_token_id=None)
            assert new[i, ids.shape[1]:].tolist() == single[0, len(row):].tolist(), i
    mask[1, -30] = 0  # a hole inside the row
    with pytest.raises(ValueError, match="at the start or the end of each row"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="does not fit the decode cache of max_position_embeddings=256 tokens"):
        model.generate(torch.randint(0, 300, (1, 250)), max_new_tokens=10, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_greedy_generate_equals_nsa_generate(runs, attention):
    from transformers import AutoModelForCausalLM

    run, folder = runs[attention]
    ours = load_for_inference(run, "cpu").model
    expected = generate(ours, _prompt()[0].tolist(), 60, temperature=0)[0]
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == ("NSAForCausalLM" if attention == "nsa" else "LlamaForCausalLM")
    for use_cache in (True, False):
        new = hf.generate(_prompt(), max_new_tokens=60, do_sample=False, use_cache=use_cache, eos_token_id=None)
        assert new[0, _prompt().shape[1]:].tolist() == expected, use_cache
    assert len(set(expected)) > 3  # a sequence that could differ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="generate() on the GPU (Triton decode kernels) needs a GPU")
def test_greedy_generate_on_the_gpu_decodes_like_the_full_forward(runs):
    """On the GPU, HF generate() through NSA's cache (Triton decode kernels) gives, at every generated position,
    the argmax of the full forward over the tokens so far (ties aside: float32 weights, margins checked)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(runs["nsa"][1]).cuda().eval()
    prompt = _prompt().cuda()
    new = hf.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        logits = hf(new).logits[0, prompt.shape[1] - 1:-1].float()  # [60, V]: the logits each new token came from
    top2 = logits.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
    assert clear.sum() > 40
    assert torch.equal(new[0, prompt.shape[1]:][clear], top2.indices[clear, 0])


def test_dense_export_is_plain_llama_without_nsa(runs):
    run, folder = runs["dense"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype=torch.float32).eval()
ids = AutoTokenizer.from_pretrained({str(folder)!r})({TEXT!r}, return_tensors="pt").input_ids
torch.save((ids, model(ids).logits, type(model).__name__), {str(folder / "out.pt")!r})
assert not any(name == "nsa" or name.startswith("nsa.") for name in sys.modules)
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=folder)
    ids, logits, name = torch.load(folder / "out.pt")
    assert name == "LlamaForCausalLM"
    assert ids[0].tolist() == get_tokenizer("byte").encode(TEXT).tolist()
    ours = load_for_inference(run, "cpu").model
    with torch.no_grad():
        torch.testing.assert_close(logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_nsa_folder_loads_without_importing_nsa(runs, tmp_path):
    """trust_remote_code=True: config.json's auto_map names the folder's configuration_nsa.py and modeling_nsa.py,
    which import the classes from nsa (or name the install line without it); the loaded model saves again into
    such a folder."""
    run, folder = runs["nsa"]
    resaved = tmp_path / "resaved"
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
assert "nsa" not in sys.modules
sys.modules["nsa"] = None  # as if nsa were not installed
try:
    AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
    raise AssertionError("loaded without nsa")
except ImportError as e:
    assert 'needs the nsa package: pip install "nsa[hf]"' in str(e), e
del sys.modules["nsa"]
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
ids = AutoTokenizer.from_pretrained({str(folder)!r})({TEXT!r}, return_tensors="pt").input_ids
model.save_pretrained({str(resaved)!r})
with torch.no_grad():
    torch.save((ids, model(ids).logits), {str(tmp_path / "out.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path,
                   env={**os.environ, "HF_HOME": str(tmp_path / "hf-home")})  # remote code is copied under HF_HOME
    ids, logits = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        torch.testing.assert_close(logits, load_for_inference(run, "cpu").model(ids), rtol=1e-5, atol=1e-5)
    for saved in (folder, resaved):
        assert json.loads((saved / "config.json").read_text())["auto_map"] == {
            "AutoConfig": "configuration_nsa.NSAConfig", "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM"}
        assert (saved / "configuration_nsa.py").is_file() and (saved / "modeling_nsa.py").is_file()
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(resaved).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_tokenizer_files_encode_as_the_runs_tokenizer(tmp_path, name):
    from transformers import AutoTokenizer

    from nsa.hf.tokenizer_files import save_tokenizer

    ours = get_tokenizer(name)
    save_tokenizer(ours, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, "  spaces   and\ttabs\n\nnew lines", "it's 2024: 12345 tokens!"):
        ids = hf(text).input_ids
        assert ids == ours.encode(text).tolist()
        assert hf.decode(ids) == text
    assert hf.eos_token_id == ours.eot_id and hf.convert_tokens_to_ids("<|endoftext|>") == ours.eot_id
    assert hf.pad_token_id == ours.eot_id  # padding=True works without setting a pad token


def test_exported_folder_serves_nsa_generate_and_eval(runs, tmp_path, capsys):
    run, folder = runs["nsa"]
    args = ["--prompt", "And God said", "--temperature", "0", "--max-new-tokens", "30", "--device", "cpu"]
    assert main(["generate", str(run), *args]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", str(folder), *args]) == 0
    assert capsys.readouterr().out == from_run
    assert main(["eval", str(folder), "--tasks", "none", "--val-batches", "1", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "eval")]) == 0
    assert "validation: loss" in capsys.readouterr().out


def test_init_from_starts_from_the_exported_weights(runs, tmp_path):
    run, folder = runs["dense"]
    exported, _ = load_hf_folder(folder)
    cfg = load_config(None, RUN + ["model.attention=dense", f"model.init_from={folder}", "train.steps=1",
                                   "train.lr=1e-9", f"train.out_dir={tmp_path}", "train.run_name=cont"])
    train(cfg)
    started = load_for_inference(tmp_path / "cont", "cpu").model
    for (name, a), (_, b) in zip(exported.state_dict().items(), started.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    train(load_config(None, RUN + ["model.attention=dense", "train.steps=1", "train.lr=1e-9",
                                   f"train.out_dir={tmp_path}", "train.run_name=fresh"]))
    fresh = load_for_inference(tmp_path / "fresh", "cpu").model  # the same launch without init_from
    assert not torch.allclose(fresh.layers[0].attn.wq.weight, started.layers[0].attn.wq.weight)


def test_init_from_of_another_shape_is_one_line(runs, tmp_path):
    _, folder = runs["dense"]
    cfg = load_config(None, RUN + [f"model.init_from={folder}", f"train.out_dir={tmp_path}", "train.run_name=x"])
    with pytest.raises(UserError, match=r"model.init_from=.* does not fit this model: it .*; set the model keys"):
        train(cfg)
    cfg = load_config(None, RUN + [f"model.init_from={tmp_path / 'none'}", f"train.out_dir={tmp_path}",
                                   "train.run_name=y"])
    with pytest.raises(UserError, match="is neither a checkpoint or run folder nor a Hugging Face model folder"):
        train(cfg)


def test_bad_export_paths_are_one_line(runs, tmp_path, capsys):
    run, folder = runs["nsa"]
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "o"), "--format", "hf"]) == 2
    assert main(["export", str(run), str(folder), "--format", "hf"]) == 2  # not empty
    assert main(["generate", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 3 and all(line.startswith("nsa: error: ") for line in errors), errors
    assert "no complete checkpoint" in errors[0] and "not an empty folder" in errors[1]
