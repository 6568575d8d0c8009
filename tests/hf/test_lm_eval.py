"""lm-evaluation-harness on an exported NSA model: its `hf` model type loads the folder in a process that has not
imported nsa (trust_remote_code=True), and what it scores in padded batches is the model's own: the loglikelihood
of each continuation, and the greedy continuation itself."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from nsa.cli import main  # noqa: E402
from nsa.config import load_config  # noqa: E402
from nsa.data.tokenizers import get_tokenizer  # noqa: E402
from nsa.inference import generate, load_for_inference  # noqa: E402
from nsa.train.loop import train  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
RUN = ["model.dim=64", "model.n_layers=2", "model.mlp_hidden=96", "model.head_dim=16", "model.init_std=0.3",
       "train.seq_len=128", "train.batch_size=2", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0",
       "train.log_every=1", "train.sample_tokens=0", "train.progress=false"]
MAX_GEN_TOKS = 12  # genesis_gen.yaml's max_gen_toks


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A short NSA run, its --format hf export, and lm_eval's samples of both local tasks (batches of 4)."""
    root = tmp_path_factory.mktemp("lm-eval")
    train(load_config(None, RUN + [f"train.out_dir={root}", "train.run_name=nsa"]))
    folder = root / "nsa-hf"
    assert main(["export", str(root / "nsa"), str(folder), "--format", "hf"]) == 0
    tasks = shutil.copytree(TASKS, root / "tasks")  # data_files resolve against the working directory
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf-home")}
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={folder},trust_remote_code=True", "--device", "cpu", "--batch_size", "4",
               "--tasks", "genesis_choice,genesis_gen", "--include_path", str(tasks),
               "--output_path", str(root / "out"), "--log_samples"]
    done = subprocess.run(command, cwd=tasks, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (root / "out").rglob("results_*.json")
    samples = {}
    for task in ("genesis_choice", "genesis_gen"):
        (logged,) = (root / "out").rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in logged.read_text().splitlines()]
    return load_for_inference(root / "nsa", "cpu").model, folder, json.loads(results.read_text()), samples


def test_lm_eval_scores_the_export(evaluated):
    _, _, results, samples = evaluated
    scores = results["results"]
    assert 0 <= scores["genesis_choice"]["acc,none"] <= 1 and 0 <= scores["genesis_gen"]["exact_match,none"] <= 1
    assert len(samples["genesis_choice"]) == len(samples["genesis_gen"]) == 4


def test_lm_eval_loglikelihoods_are_the_models(evaluated):
    """lm_eval right-pads each batch with no attention_mask: causal attention keeps every row's scores its own."""
    model, _, _, samples = evaluated
    byte = get_tokenizer("byte")
    scored = 0
    for sample in samples["genesis_choice"]:
        for (context, continuation), ((logprob, _),) in zip(
                [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()], sample["resps"], strict=True):
            ctx, cont = byte.encode(context).tolist(), byte.encode(continuation).tolist()
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont]))[0, len(ctx) - 1:-1].float().log_softmax(-1)
            expected = logits.gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert float(logprob) == pytest.approx(expected, abs=1e-4), (context, continuation)
            scored += 1
    assert scored == 11  # every choice of every verse


def test_lm_eval_generations_are_the_models(evaluated):
    """lm_eval left-pads each batch for generate(): every row continues as it would alone."""
    from transformers import AutoTokenizer

    model, folder, _, samples = evaluated
    tokenizer = AutoTokenizer.from_pretrained(folder)
    byte = get_tokenizer("byte")
    texts = []
    for sample in samples["genesis_gen"]:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        new = generate(model, byte.encode(prompt).tolist(), MAX_GEN_TOKS, temperature=0, stop_id=byte.eot_id)[0]
        text = tokenizer.decode(new, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == text, prompt
        texts.append(text)
    assert len(set(texts)) > 1  # continuations that could differ
