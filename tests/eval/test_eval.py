"""`nsa eval` and `nsa compare`: the retrieval generator, its training source, exact-match scoring, and both
commands end to end on tiny runs (CPU, short contexts)."""

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nsa.cli import main
from nsa.config import load_config
from nsa.data.loader import RetrievalBatches, build_data
from nsa.data.tokenizers import ByteTokenizer, get_tokenizer
from nsa.errors import UserError
from nsa.eval import runner
from nsa.eval.compare import USED_GATE, render_compare
from nsa.eval.intervals import wilson_interval
from nsa.data.retrieval import FILLER, LABELS, RetrievalTasks, example_rng
from nsa.eval.scoring import answer_hits, answer_logits, exact_match
from nsa.inference.generate import generate
from nsa.model import Transformer
from nsa.model.config import ModelConfig
from nsa.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.mlp_hidden=64", "train.seq_len=128", "train.batch_size=4", "train.steps=6", "train.warmup_steps=2",
    "train.eval_every=3", "train.eval_batches=2", "train.log_every=2", "train.sample_tokens=0",
    "train.progress=false", "telemetry.health_every=3", "telemetry.tensorboard=false",
]


def tokenizers():
    out = [ByteTokenizer()]
    try:
        out.append(get_tokenizer("gpt2"))
    except UserError:  # no offline GPT-2 ranks file on this machine
        pass
    return out


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1024, path


# ------------------------------------------------------------------------------------------ generator


@pytest.mark.parametrize("tokenizer", tokenizers(), ids=lambda t: t.name)
@pytest.mark.parametrize("task", ["passkey", "kv", "multikey"])
def test_examples_hit_the_length_exactly_and_put_the_needle_at_the_depth(tokenizer, task):
    tasks = RetrievalTasks(tokenizer, kv_pairs=6)
    longest_sentence = max(len(tokenizer.encode(s)) for s in FILLER)
    for length in (256, 301, 1024):
        for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            ex = tasks.example(task, length, depth, example_rng(7, length, int(depth * 100)))
            assert ex.tokens.dtype == np.int64 and len(ex.tokens) == length
            question_len = ex.answer_start - ex.needle_start - ex.needle_len  # at depth 1, nothing in between
            haystack = ex.answer_start - len(tokenizer.encode(_question(task, tokenizer, ex)))
            assert ex.question_start == haystack  # the question follows the haystack
            # The needle sits at a gap between sentences (or pairs): within one such unit of the request.
            assert abs(ex.needle_start - depth * (haystack - ex.needle_len)) <= max(longest_sentence, 40)
            assert ex.depth == pytest.approx(ex.needle_start / (haystack - ex.needle_len))
            if depth == 0.0:
                assert ex.needle_start == 0
            if depth == 1.0:
                assert ex.needle_start + ex.needle_len == haystack and question_len > 0
            needle = tokenizer.decode(ex.tokens[ex.needle_start:ex.needle_start + ex.needle_len])
            answer = tokenizer.decode(ex.tokens[ex.answer_start:])
            assert answer == " " + ex.answer
            # The key's first token follows only the leading space: its own token for bytes, merged for GPT-2.
            key_at = ex.answer_start + ex.key_offset
            assert tokenizer.decode(ex.tokens[ex.answer_start:key_at]).strip() == ""
            first = tokenizer.decode(ex.tokens[key_at:key_at + 1]).strip()
            assert first and ex.answer.startswith(first)
            assert ex.key_offset == (1 if tokenizer.name == "byte" else 0)
            if task == "passkey":
                assert needle == f" The pass key is {ex.answer}. Remember it."
                assert len(ex.answer) == 5 and ex.answer.isdigit()
            elif task == "multikey":
                label = needle.split(" ")[2]
                assert needle == f" The {label} pass key is {ex.answer}. Remember it." and label in LABELS
                assert len(ex.answer) == 5 and ex.answer.isdigit()
                text = tokenizer.decode(ex.tokens)
                assert text.count(f" {label} pass key") == 3  # the needle and the question's two, no distractor
                assert text.endswith(f" What is the {label} pass key? The {label} pass key is {ex.answer}")
                assert text.count(" pass key is ") == ex.distractors + 2
                if length == 1024:
                    assert ex.distractors == 5  # all six needles fit in half of 1024 tokens
            else:
                key = needle.split("key ")[1].split(" ")[0]
                assert needle == f" The value of key {key} is {ex.answer}."
                text = tokenizer.decode(ex.tokens)
                assert text.count(f"key {key} is") == 2  # the pair and the question, never a distractor
                assert text.endswith(f" What is the value of key {key}? The value of key {key} is {ex.answer}")
                assert text.count("The value of key") == ex.distractors + 2
                if length == 1024:
                    assert ex.distractors == 5  # all pairs fit in half of 1024 tokens


def _question(task, tokenizer, ex):
    if task == "passkey":
        return " What is the pass key? The pass key is"
    if task == "multikey":
        label = tokenizer.decode(ex.tokens[ex.needle_start:ex.needle_start + ex.needle_len]).split(" ")[2]
        return f" What is the {label} pass key? The {label} pass key is"
    key = tokenizer.decode(ex.tokens[ex.needle_start:ex.needle_start + ex.needle_len]).split("key ")[1].split(" ")[0]
    return f" What is the value of key {key}? The value of key {key} is"


def test_examples_are_deterministic_per_seed_and_short_lengths_are_refused():
    tasks = RetrievalTasks(ByteTokenizer())
    a = tasks.example("kv", 512, 0.3, example_rng(1, 2))
    b = tasks.example("kv", 512, 0.3, example_rng(1, 2))
    c = tasks.example("kv", 512, 0.3, example_rng(1, 3))
    assert np.array_equal(a.tokens, b.tokens) and a.answer == b.answer
    assert not np.array_equal(a.tokens, c.tokens)
    with pytest.raises(ValueError, match="needs at least"):
        tasks.example("passkey", 60, 0.5, example_rng(0))


# -------------------------------------------------------------------------------------- training source


def drain(stream, n):
    return [stream.next_batch() for _ in range(n)]


def test_retrieval_source_resumes_exactly_and_validation_differs():
    tasks = RetrievalTasks(ByteTokenizer(), kv_pairs=4)
    stream = RetrievalBatches(tasks, "mixed", 200, 3, seed=5, rank=1)
    drain(stream, 3)
    state = json.loads(json.dumps(stream.state_dict()))
    expected = drain(stream, 4)
    resumed = RetrievalBatches(tasks, "mixed", 200, 3, seed=5, rank=1)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(drain(resumed, 4), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    x, y = expected[0]
    assert x.shape == y.shape == (3, 200) and torch.equal(x[:, 1:], y[:, :-1])
    texts = [ByteTokenizer().decode(row.tolist()) for row in y]
    assert all(" is " in t[-12:] for t in texts)  # every row ends with its answer

    # data.retrieval.loss=answer: the same inputs, and targets only on the answer (" NNNNN": 6 bytes at the end).
    full = RetrievalBatches(tasks, "passkey", 200, 3, seed=5).next_batch()
    x, y = RetrievalBatches(tasks, "passkey", 200, 3, seed=5, answer_only=True).next_batch()
    kept = y != -1
    assert torch.equal(x, full[0]) and kept[:, -6:].all() and (kept.sum(1) == 6).all()
    assert torch.equal(y[kept], full[1][kept])

    # data.retrieval.tail: the answer ends up to `tail` tokens before the sequence does, filler after it, and the
    # answer-only targets follow it there.
    x, y = RetrievalBatches(tasks, "passkey", 200, 16, seed=5, answer_only=True, tail=32).next_batch()
    kept = y != -1
    positions = torch.arange(200).expand(16, -1)
    first, last = positions.masked_fill(~kept, 999).amin(1), positions.masked_fill(~kept, -1).amax(1)
    assert (kept.sum(1) == 6).all() and (last - first == 5).all()  # one contiguous 6-token answer per row
    assert len(set(last.tolist())) > 4 and (last >= 199 - 32).all() and (last < 199).any()
    decode = ByteTokenizer().decode
    for row in range(16):
        a, b = int(first[row]), int(last[row])
        assert decode(x[row, :a + 1].tolist()).endswith(" The pass key is")
        assert re.fullmatch(r" [1-9]\d{4}", decode(y[row, a:b + 1].tolist()))
        assert not re.search(r"\d", decode(x[row, b + 2:].tolist()))  # filler after the answer
    full = RetrievalBatches(tasks, "passkey", 200, 16, seed=5, tail=32).next_batch()
    assert torch.equal(x, full[0]) and torch.equal(y[kept], full[1][kept])
    with pytest.raises(UserError, match="train.seq_len=100 less data.retrieval.tail=40 is too short"):
        RetrievalBatches(tasks, "passkey", 100, 1, seed=5, tail=40)

    # data.retrieval.depth_ends: that share of needles sits first in the haystack or right before the question
    # (a uniform depth puts it at either end of ~100 sentence gaps about 1 time in 50).
    def needle_places(depth_ends):
        x, _ = RetrievalBatches(tasks, "passkey", 2000, 64, seed=5, depth_ends=depth_ends).next_batch()
        texts = [decode(row.tolist()) for row in x]
        first = sum(t.startswith(" The pass key is") for t in texts)
        last = sum(bool(re.search(r"Remember it\. What is the pass key\?", t)) for t in texts)
        return first, last
    assert sum(needle_places(0.0)) <= 3
    first, last = needle_places(0.5)
    assert 8 <= first <= 24 and 8 <= last <= 24
    assert sum(needle_places(1.0)) == 64
    with pytest.raises(UserError, match="depth_ends is a share"):
        RetrievalBatches(tasks, "passkey", 200, 1, seed=5, depth_ends=1.5)

    cfg = load_config(None, ["data.source=retrieval", "data.retrieval.task=passkey", "train.seq_len=256"])
    data = build_data(cfg.data, ByteTokenizer(), 256, 2, 2, seed=9)
    train_x = data.train.next_batch()[0]
    data.train.close()
    assert len(data.val) == 2 and not torch.equal(train_x, data.val[0][0])
    other_rank = build_data(cfg.data, ByteTokenizer(), 256, 2, 2, seed=9, rank=1, world=2)
    assert not torch.equal(other_rank.train.next_batch()[0], train_x)
    other_rank.train.close()
    with pytest.raises(UserError, match="too short for data.retrieval.task=kv"):
        build_data(load_config(None, ["data.source=retrieval", "data.retrieval.task=kv"]).data, ByteTokenizer(),
                   40, 2, 1, seed=0)


def test_retrieval_mix_lengths_draws_lengths_per_step_with_equal_tokens():
    tasks = RetrievalTasks(ByteTokenizer())
    decode = ByteTokenizer().decode

    def stream(rank=0):
        return RetrievalBatches(tasks, "passkey", 200, 4, seed=5, rank=rank, answer_only=True, mix_lengths=[400, 800])
    batches = drain(stream(), 30)
    shapes = [tuple(x.shape) for x, _ in batches]
    assert set(shapes) == {(4, 200), (2, 400), (1, 800)} and max(map(shapes.count, set(shapes))) < 20
    for x, y in batches:
        kept = y != -1
        assert (kept.sum(1) == 6).all() and kept[:, -6:].all()  # the answer ends every row, whatever its length
        assert all(decode(row[-21:-5].tolist()) == " The pass key is" for row in x)
    # Every rank draws the same length at a step (DDP needs equal shapes), with its own examples.
    other = drain(stream(rank=1), 30)
    assert [tuple(x.shape) for x, _ in other] == shapes and not torch.equal(other[0][0], batches[0][0])
    # Exact resume: the length draw follows the position as the examples do.
    resumed = stream()
    resumed.load_state_dict({"counter": 7})
    assert all(torch.equal(a[0], b[0]) for a, b in zip(drain(resumed, 5), batches[7:12]))
    # Without mix_lengths the stream is the one it always was.
    plain = RetrievalBatches(tasks, "passkey", 200, 4, seed=5, answer_only=True)
    first = plain.next_batch()[0]
    assert first.shape == (4, 200)
    assert torch.equal(first, RetrievalBatches(tasks, "passkey", 200, 4, seed=5, mix_lengths=[]).next_batch()[0])
    with pytest.raises(UserError, match="mix_lengths holds 300, which does not divide the 800 tokens"):
        RetrievalBatches(tasks, "passkey", 200, 4, seed=5, mix_lengths=[300])
    with pytest.raises(UserError, match="mix_lengths' 40 is too short"):
        RetrievalBatches(tasks, "passkey", 200, 4, seed=5, mix_lengths=[40])
    # The config key reaches the training stream.
    cfg = load_config(None, ["data.source=retrieval", "data.retrieval.mix_lengths=[512]", "train.seq_len=256"])
    data = build_data(cfg.data, ByteTokenizer(), 256, 2, 1, seed=9)
    shapes = {tuple(data.train.next_batch()[0].shape) for _ in range(12)}
    data.train.close()
    assert shapes == {(2, 256), (1, 512)} and data.val[0][0].shape == (2, 256)


# -------------------------------------------------------------------------------------------- scoring


class CopyModel(nn.Module):
    """Logits that put all mass on a fixed next token per position: the answer it 'knows' is `script`."""

    def __init__(self, script: torch.Tensor, vocab: int = 300):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens):
        self.read = tokens.shape[1]
        nxt = torch.cat([self.script[:, 1:], self.script[:, :1]], dim=1)  # position t predicts script[t + 1]
        return torch.nn.functional.one_hot(nxt[:, :tokens.shape[1]], self.vocab).float() * 10 + self.dummy


def test_needle_selection_reads_every_query_of_the_question():
    tasks = RetrievalTasks(ByteTokenizer())
    examples = [tasks.example(task, 300, 0.5, example_rng(4, i)) for i, task in enumerate(["passkey", "kv"])]
    queries = runner._question_queries(examples, torch.device("cpu"))
    decode = ByteTokenizer().decode
    for row, ex in zip(queries.tolist(), examples):
        span = ex.answer_start - ex.question_start
        assert row[:span] == list(range(ex.question_start, ex.answer_start))
        assert set(row[span:]) <= {ex.answer_start - 1}  # the shorter question repeats its last query
        assert decode(ex.tokens[row[0]:row[span - 1] + 1].tolist()).startswith(" What is the")
    assert queries.shape[1] == max(ex.answer_start - ex.question_start for ex in examples)


def test_exact_match_scores_the_answer_tokens_only():
    tasks = RetrievalTasks(ByteTokenizer())
    examples = [tasks.example(task, 256, 0.5, example_rng(3, i)) for i, task in enumerate(["passkey", "kv", "kv"])]
    tokens = torch.from_numpy(np.stack([e.tokens for e in examples]))
    start = torch.tensor([e.answer_start for e in examples])
    length = torch.tensor([e.answer_len for e in examples]) - torch.tensor([0, 0, 2])  # rows may differ
    model = CopyModel(tokens)
    assert exact_match(model, tokens, start, length).tolist() == [True, True, True]
    assert model.read == 255  # as the trainer reads an example of seq_len + 1 tokens: the last is only a target

    wrong = tokens.clone()
    wrong[0, -1] = (wrong[0, -1] + 1) % 256  # the model believes another last digit
    wrong[1, 10] = (wrong[1, 10] + 1) % 256  # a filler token: not part of the answer
    wrong[2, -1] = (wrong[2, -1] + 1) % 256  # beyond row 2's (shortened) answer
    assert exact_match(CopyModel(wrong), tokens, start, length).tolist() == [False, True, True]
    wrong[2, int(start[2])] = 0  # row 2's first answer token
    assert exact_match(CopyModel(wrong), tokens, start, length).tolist() == [False, True, False]
    # Per answer token: row 0 missed only its last token, row 2 only its first; past row 2's answer counts as a hit.
    hits = answer_hits(CopyModel(wrong), tokens, start, length)
    assert hits.shape == (3, int(length.max()))
    assert hits[:, 0].tolist() == [True, True, False] and hits[0, :-1].all() and not hits[0, -1]
    assert hits[2, 1:].all() and hits[1].all()


def test_the_first_token_share_counts_the_key_not_the_leading_space():
    # Bytes give the answer's leading space a token of its own, which the prompt makes trivial: a model that
    # gets the space right and the key's first digit wrong never found the key.
    tasks = RetrievalTasks(ByteTokenizer())
    examples = [tasks.example("passkey", 200, 0.5, example_rng(5, i)) for i in range(3)]
    tokens = torch.from_numpy(np.stack([e.tokens for e in examples]))
    script = tokens.clone()
    for row, wrong_at in ((0, 1), (1, 2)):  # row 0: the key's first digit; row 1: its second
        at = examples[row].answer_start + wrong_at
        script[row, at] = ord("0") + (int(chr(int(script[row, at]))) + 1) % 10
    scores = runner._score(CopyModel(script), examples, 3, torch.device("cpu"), lambda n: None)
    assert scores.exact == [False, False, True]
    assert scores.first == [False, True, True]


def test_exact_match_agrees_with_greedy_decoding_of_a_real_model():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                    mlp_hidden=64)).eval()
    prompt = torch.randint(0, 256, (150,))
    decoded = torch.tensor(generate(model, prompt.tolist(), 4, temperature=0.0)[0])
    tokens = torch.cat([prompt, decoded])[None]
    start, length = torch.tensor([150]), torch.tensor([4])
    assert exact_match(model, tokens, start, length).tolist() == [True]
    changed = tokens.clone()
    changed[0, 152] = (changed[0, 152] + 1) % 320
    assert exact_match(model, changed, start, length).tolist() == [False]
    # The output head applied at a few positions equals the full forward's logits there.
    positions = torch.tensor([[149, 150, 151, 152]])
    with torch.no_grad():
        full = model(tokens)[0, 149:153]
        assert torch.allclose(answer_logits(model, tokens, positions)[0], full, atol=1e-5)


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs (NSA, dense) of a few steps, evaluated at short lengths."""
    root = tmp_path_factory.mktemp("runs")
    for attention in ("nsa", "dense"):
        train(load_config(None, TINY + [f"model.attention={attention}", f"train.out_dir={root}",
                                        f"train.run_name={attention}"]))
    return root


def test_eval_writes_csv_json_and_heatmaps(runs, capsys):
    code = main(["eval", str(runs / "nsa"), "--lengths", "256,128,90", "--depths", "0,0.5,1", "--samples", "2",
                 "--val-batches", "2", "--no-progress"])
    assert code == 0
    out = runs / "nsa" / "eval"
    rows = list(csv.DictReader(open(out / "eval.csv")))
    assert list(rows[0]) == ["task", "length", "depth", "samples", "correct", "accuracy", "ci_low", "ci_high",
                             "first_token", "needle_selected"]
    # kv does not fit in 90 tokens: that length is skipped for kv only.
    cells = {(r["task"], int(r["length"]), float(r["depth"])) for r in rows}
    assert cells == {("passkey", n, d) for n in (90, 128, 256) for d in (0, 0.5, 1)} | {
        ("kv", n, d) for n in (128, 256) for d in (0, 0.5, 1)}
    for r in rows:  # each cell: its samples, the correct ones among them, and their 95% Wilson interval
        assert r["samples"] == "2" and r["correct"] in ("0", "1", "2")
        assert float(r["accuracy"]) == int(r["correct"]) / 2
        low, high = wilson_interval(int(r["correct"]), 2)
        assert (float(r["ci_low"]), float(r["ci_high"])) == (round(low, 4), round(high, 4))
        assert float(r["ci_low"]) <= float(r["accuracy"]) <= float(r["ci_high"]) and high - low > 0.5
        assert float(r["first_token"]) >= float(r["accuracy"]) and float(r["first_token"]) in (0, 0.5, 1)
    info = json.loads((out / "eval.json").read_text())
    assert info["step"] == 6 and info["attention"] == "nsa" and info["trained_seq_len"] == 128
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"  # --device auto
    assert info["device"] == device and info["versions"]["torch"] == torch.__version__
    assert info["validation"]["batches"] == 2 and math.isclose(
        info["validation"]["perplexity"], math.exp(info["validation"]["loss"]), rel_tol=1e-9)
    assert [(s["task"], s["length"]) for s in info["retrieval"]["skipped"]] == [("kv", 90)]
    assert set(info["retrieval"]["mean_accuracy"]) == {"passkey", "kv"}
    # Per task and length, over every sample of the length: 3 depths x 2 samples.
    for task, length in (("passkey", 90), ("kv", 256)):
        pooled = info["retrieval"]["mean_accuracy_interval"][task][str(length)]
        cell_rows = [r for r in rows if r["task"] == task and r["length"] == str(length)]
        correct = sum(int(r["correct"]) for r in cell_rows)
        assert pooled["samples"] == 6 and pooled["correct"] == correct
        assert info["retrieval"]["mean_accuracy"][task][str(length)] == correct / 6
        assert (pooled["ci_low"], pooled["ci_high"]) == pytest.approx(wilson_interval(correct, 6))
        first = sum(float(r["first_token"]) * 2 for r in cell_rows) / 6
        assert info["retrieval"]["first_token"][task][str(length)] == pytest.approx(first)
    assert "90" not in info["retrieval"]["mean_accuracy_interval"]["kv"]
    for task in ("passkey", "kv"):
        assert_png(out / f"retrieval_{task}.png")
    # A passkey needle at depth 0 lies in the forced block 0, at depth 1 in the query's forced previous block.
    passkey_ends = [float(r["needle_selected"]) for r in rows if r["task"] == "passkey" and r["depth"] in ("0", "1")]
    assert passkey_ends == [1.0] * 6
    assert all(0.0 <= float(r["needle_selected"]) <= 1.0 for r in rows)
    by_layer = info["retrieval"]["needle_selected_by_layer"]["passkey"]["256"]
    assert len(by_layer) == 2 and all(0.0 <= v <= 1.0 for v in by_layer)
    gates = info["retrieval"]["question_gates_by_layer"]["passkey"]["256"]  # [layers][cmp, sel, win]
    assert len(gates) == 2 and all(len(g) == 3 and all(0.0 < v < 1.0 for v in g) for g in gates)
    printed = capsys.readouterr().out
    assert "validation: loss" in printed and "passkey: exact-match accuracy of 2 samples per cell" in printed
    table = printed.split("passkey: exact-match accuracy")[1].split("needle block selected")[0]
    pooled = info["retrieval"]["mean_accuracy_interval"]["passkey"]["128"]
    assert re.search(r"^ *mean( +[0-9.]+){3}$", table, re.M)
    assert re.search(rf"^ *95% CI .* {pooled['ci_low']:.2f}-{pooled['ci_high']:.2f} ", table, re.M)
    assert re.search(r"^ *samples +6 +6 +6$", table, re.M)
    firsts = info["retrieval"]["first_token"]["passkey"]
    assert re.search(r"^ *1st token +" + " +".join(f"{firsts[n]:.2f}" for n in ("90", "128", "256")) + "$", table, re.M)
    assert "passkey: needle block selected" in printed
    # The per-layer table: layer 1's row at 256 tokens holds its selection share and its three gates.
    layers = printed.split("passkey: per layer at the queries of the question")[1].split("\n\n")[0]
    one = "/".join(f"{g:.2f}" for g in gates[1])
    assert re.search(rf"^ +1 .* {by_layer[1]:.2f}  {one}$", layers, re.M)


def test_eval_with_a_layers_attention_removed_writes_beside_the_models_own_scores(runs, capsys):
    args = ["eval", str(runs / "nsa"), "--lengths", "128", "--depths", "0,1", "--samples", "2", "--tasks",
            "passkey", "--val-batches", "2", "--no-progress"]
    assert main(args + ["--out", str(runs / "nsa" / "eval-whole")]) == 0
    assert main(args + ["--ablate-attention", "1,0"]) == 0
    assert "attention removed (outputs zeros) in layer(s) 0, 1" in capsys.readouterr().out
    whole = json.loads((runs / "nsa" / "eval-whole" / "eval.json").read_text())
    ablated = json.loads((runs / "nsa" / "eval-ablate-0-1" / "eval.json").read_text())
    assert whole["ablated_attention"] == [] and ablated["ablated_attention"] == [0, 1]
    assert ablated["validation"]["loss"] != pytest.approx(whole["validation"]["loss"], rel=1e-4)
    assert main(args + ["--ablate-attention", "2"]) == 2
    assert "--ablate-attention: layer 2 does not exist; the model has layers 0-1" in capsys.readouterr().err
    assert not (runs / "nsa" / "eval-ablate-2").exists()


def test_eval_sweeps_the_layers_one_removed_at_a_time(runs, capsys):
    args = ["eval", str(runs / "nsa"), "--lengths", "128,256", "--depths", "0,1", "--samples", "2", "--tasks",
            "passkey", "--no-progress"]
    assert main(args + ["--ablate-each-layer"]) == 0
    printed = capsys.readouterr().out
    out = runs / "nsa" / "eval-ablate-each"
    rows = list(csv.DictReader(open(out / "ablation.csv")))
    assert [(r["ablated"], r["length"]) for r in rows] == [(a, n) for a in ("none", "0", "1") for n in ("128", "256")]
    assert all(r["samples"] == "4" and r["task"] == "passkey" for r in rows) and (out / "ablation_passkey.png").exists()
    # Each pass equals the plain evaluation under the same ablation (same examples), pooled over the depths.
    for ablated in ("none", "0", "1"):
        extra = [] if ablated == "none" else ["--ablate-attention", ablated]
        assert main(args + extra + ["--val-batches", "0", "--out", str(runs / "nsa" / f"sweep-{ablated}")]) == 0
        plain = json.loads((runs / "nsa" / f"sweep-{ablated}" / "eval.json").read_text())["retrieval"]
        for r in (r for r in rows if r["ablated"] == ablated):
            pooled = plain["mean_accuracy_interval"]["passkey"][r["length"]]
            assert int(r["correct"]) == pooled["correct"] and float(r["accuracy"]) == pytest.approx(
                plain["mean_accuracy"]["passkey"][r["length"]], abs=1e-4)
            assert float(r["first_token"]) == pytest.approx(plain["first_token"]["passkey"][r["length"]], abs=1e-4)
    table = printed.split("by the layer whose attention was removed")[1]
    first = rows[0]
    assert re.search(rf"^ *none +{float(first['accuracy']):.2f} \({float(first['ci_low']):.2f}-", table, re.M)
    assert re.search(r"^ *layer 1 ", table, re.M)
    capsys.readouterr()
    assert main(args + ["--ablate-each-layer", "--ablate-attention", "1"]) == 2
    assert "--ablate-each-layer removes one layer at a time" in capsys.readouterr().err


def test_the_layer_table_shows_each_layers_selection_and_gates_per_length():
    retrieval = {"needle_selected_by_layer": {"passkey": {"4096": [1.0, 0.25], "8192": [0.5, 0.75]}},
                 "question_gates_by_layer": {"passkey": {"4096": [[0.2, 0.3, 0.5], [0.1, 0.8, 0.1]],
                                                         "8192": [[0.3, 0.3, 0.4], [0.6, 0.2, 0.2]]}}}
    lines = runner.layer_table(retrieval, "passkey").splitlines()
    assert lines[0].split() == ["layer", "4K", "8K"]
    assert lines[2].split() == ["0", "1.00", "0.20/0.30/0.50", "0.50", "0.30/0.30/0.40"]
    assert lines[3].split() == ["1", "0.25", "0.10/0.80/0.10", "0.75", "0.60/0.20/0.20"]
    assert len(runner.layer_table(retrieval, "kv").splitlines()) == 2  # a task without records: no rows


def test_eval_takes_32_samples_per_cell_unless_told(monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "run_eval", lambda target, opts: seen.append(opts))
    assert main(["eval", "runs/x"]) == 0 and main(["eval", "runs/x", "--samples", "3"]) == 0
    assert [opts.samples for opts in seen] == [32, 3]
    assert runner.EvalOptions(lengths=[128], depths=[0.0], tasks=["kv"]).samples == 32


@pytest.mark.parametrize("task", ["kv", "multikey"])
def test_the_harder_tasks_train_as_retrieval_sources_and_are_evaluated_with_intervals(tmp_path, capsys, task):
    """kv (the queried key among distractor pairs of the same form) and multikey (the queried label's pass key
    among other labelled pass keys) train with data.retrieval.task and are scored cell by cell like passkey."""
    train(load_config(None, TINY + ["data.source=retrieval", f"data.retrieval.task={task}",
                                    "data.retrieval.kv_pairs=4", "train.steps=2", "train.eval_every=2",
                                    f"train.out_dir={tmp_path}", f"train.run_name={task}"]))
    assert f"synthetic {task} retrieval examples" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / task), "--tasks", task, "--lengths", "128,160", "--depths", "0,1",
                 "--samples", "3", "--val-batches", "1", "--no-progress"]) == 0
    out = tmp_path / task / "eval"
    rows = list(csv.DictReader(open(out / "eval.csv")))
    assert [(r["task"], r["length"], r["depth"], r["samples"]) for r in rows] == [
        (task, n, d, "3") for n in ("128", "160") for d in ("0", "1")]
    for r in rows:
        low, high = wilson_interval(int(r["correct"]), 3)
        assert (float(r["ci_low"]), float(r["ci_high"])) == (round(low, 4), round(high, 4))
    info = json.loads((out / "eval.json").read_text())["retrieval"]
    assert info["kv_pairs"] == 4 and info["mean_accuracy_interval"][task]["160"]["samples"] == 6


def test_eval_of_a_dense_model_leaves_needle_selection_blank(runs, tmp_path):
    assert main(["eval", str(runs / "dense"), "--lengths", "128", "--depths", "0,1", "--samples", "1", "--tasks",
                 "passkey", "--val-batches", "0", "--no-progress", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "eval.csv")))
    assert [r["needle_selected"] for r in rows] == ["", ""]
    assert json.loads((tmp_path / "eval.json").read_text())["retrieval"]["needle_selected"] == {}


def test_eval_builds_each_length_in_the_trainers_layout(runs, monkeypatch, tmp_path):
    """A context of L tokens is an example of L + 1 tokens ending in its answer, read without its last token:
    the model sees its question end where training at train.seq_len = L put it (NSA's blocks are aligned to
    positions, so a model trained at one length may rely on that place)."""
    seen = []
    real = runner.answer_hits

    def spy(model, tokens, start, length):
        seen.append((tokens.shape[1], (start + length).tolist()))
        return real(model, tokens, start, length)

    monkeypatch.setattr(runner, "answer_hits", spy)
    assert main(["eval", str(runs / "nsa"), "--lengths", "128", "--depths", "0,1", "--samples", "1", "--tasks",
                 "passkey", "--val-batches", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    assert seen == [(129, [129, 129])]


def test_eval_reports_a_length_that_runs_out_of_memory_as_skipped(runs, monkeypatch, tmp_path, capsys):
    real = runner.answer_hits

    def limited(model, tokens, start, length):
        if tokens.shape[1] > 200:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(model, tokens, start, length)

    monkeypatch.setattr(runner, "answer_hits", limited)
    result = runner.run_eval(runs / "dense", runner.EvalOptions(
        lengths=[128, 256], depths=[0.0, 1.0], tasks=["passkey"], samples=2, val_batches=0, out=tmp_path,
        progress=False))
    assert result.validation is None and {r["length"] for r in result.rows} == {128}
    assert result.skipped == [{"task": "passkey", "length": 256, "reason": result.skipped[0]["reason"]}]
    assert result.skipped[0]["reason"].startswith("out of memory at batch 256 (CUDA out of memory.")
    assert "skip" in capsys.readouterr().out


def test_eval_says_why_a_length_too_short_for_a_task_is_skipped(runs, tmp_path, capsys):
    assert main(["eval", str(runs / "nsa"), "--lengths", "64,128", "--depths", "0,1", "--samples", "1",
                 "--val-batches", "0", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    skipped = json.loads((tmp_path / "eval.json").read_text())["retrieval"]["skipped"]
    assert [(s["task"], s["length"]) for s in skipped] == [("passkey", 64), ("kv", 64)]
    for s in skipped:
        needed = int(re.fullmatch(rf"too short \(a {s['task']} example needs a context of at least (\d+) tokens; "
                                  r"give --lengths (\d+) or more\)", s["reason"]).group(1))
        assert 64 < needed <= 128
        assert f"skip at 64: {s['reason']}\n" in printed
    # The reason's length is enough: the first example at it is built.
    tasks = RetrievalTasks(ByteTokenizer(), 8)
    needed = int(skipped[0]["reason"].split("at least ")[1].split()[0])
    tasks.example("passkey", needed + 1, 0.0, example_rng(0, 0, needed, 0, 0))


def _text_folder(root: Path, documents: int) -> Path:
    root.mkdir()
    for i in range(documents):
        (root / f"doc{i}.txt").write_text(f"Document {i} says something new. " * 20)
    return root


def test_eval_names_why_there_is_no_validation_loss(runs, tmp_path, capsys):
    one = tmp_path / "one-shards"
    assert main(["prepare", "data.source=text", f"data.path={_text_folder(tmp_path / 'one', 1)}", "--out",
                 str(one)]) == 0
    four = tmp_path / "four-shards"
    assert main(["prepare", "data.source=text", f"data.path={_text_folder(tmp_path / 'four', 4)}", "--out",
                 str(four)]) == 0
    assert "val: 1 documents" in capsys.readouterr().out
    common = ["--tasks", "none", "--val-batches", "1", "--no-progress", "--out", str(tmp_path / "eval")]
    cases = [
        ([f"data.path={one}", "data.source=shards"],
         f"validation: skipped: the shards in '{one}' hold no validation documents (nsa prepare held out none); "
         "prepare them again from at least 2 documents, or pass --val-batches 0"),
        (["data.val_fraction=0"], "validation: skipped: the run's data.val_fraction is 0, so its data holds nothing "
                                  "out; evaluate with an override such as data.val_fraction=0.05, or pass "
                                  "--val-batches 0"),
        ([f"data.path={four}", "data.source=shards"], "validation: loss "),
    ]
    for overrides, message in cases:
        assert main(["eval", str(runs / "nsa"), *overrides, *common]) == 0
        assert message in capsys.readouterr().out, overrides


def test_compare_two_runs(runs, tmp_path):
    for name in ("nsa", "dense"):
        if not (runs / name / "eval" / "eval.csv").exists():
            runner.run_eval(runs / name, runner.EvalOptions(lengths=[128], depths=[0.0, 1.0], tasks=["passkey"],
                                                            samples=1, val_batches=1, progress=False))
    report = render_compare([runs / "nsa", runs / "dense"], tmp_path / "cmp")
    text = report.read_text()
    for name in ("loss.png", "retrieval_passkey.png", "gates.png"):
        assert_png(tmp_path / "cmp" / name)
        assert f"![]({name})" in text
    assert "| nsa | nsa | 1337 | 6 |" in text and "| dense | dense | 1337 | 6 |" in text and ") at step 6 |" in text
    assert "**Margin:** NSA's mean validation loss is" in text
    assert "| nsa (nsa) |" in text and "| dense (dense) |" in text  # both heatmaps' rows
    # NSA's needle selection, from its eval.json; dense has no row.
    table = text.split("Needle block selected at a query of the question")[1].split("Per attention kind")[0]
    nsa_row = re.search(r"^\| nsa \| ([0-9.| ]+)\|$", table, re.M)
    info = json.loads((runs / "nsa" / "eval" / "eval.json").read_text())["retrieval"]
    first = min(int(n) for n in info["needle_selected"]["passkey"])
    assert nsa_row and nsa_row.group(1).split("|")[0].strip() == f"{info['needle_selected']['passkey'][str(first)]:.2f}"
    assert "| dense | " not in table
    # The key's first-token share, from each run's eval.json: both attentions have it.
    firsts = text.split("The key's first token right")[1].split("Needle block selected")[0]
    header = re.search(r"^\| run \|(.*)\|$", firsts, re.M).group(1).split("|")
    column = [h.strip() for h in header].index("128")  # both runs were evaluated at 128 tokens (the others may differ)
    for name in ("nsa", "dense"):
        share = json.loads((runs / name / "eval" / "eval.json").read_text())["retrieval"]["first_token"]["passkey"]
        row = re.search(rf"^\| {name} \|(.*)\|$", firsts, re.M).group(1).split("|")
        assert row[column].strip() == f"{share['128']:.2f}", firsts
    assert "| nsa | 6 |" in text and "all three used?" in text  # the NSA run's gates; dense has none


# ------------------------------------------------------------------------------ compare, fake runs


def fake_run(root: Path, name: str, attention: str, seed: int, final_val: float, gates=None,
             correct: dict[int, list[int]] | None = None, samples: int = 4, old_csv: bool = False,
             gate: str | None = None, spread_penalty: float = 0.0, gate_floor: float = 0.0) -> Path:
    """A run folder with metrics.csv and config.yaml; gates: nsa_stats.jsonl's gate means per layer; correct:
    eval/eval.csv of passkey, per length the correct answers at each depth (of `samples`), without the correct
    and interval columns when old_csv (as `nsa eval` wrote it before it had them)."""
    run = root / name
    run.mkdir(parents=True)
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tokens", "loss", "val_loss"])
        for step in (10, 20, 30, 40):
            w.writerow([step, step * 1000, 5.0 - step / 20, final_val + (40 - step) / 100 if step % 20 == 0 else ""])
    gate_line = f"  nsa:\n    gate: {gate}\n" if gate else ""
    if spread_penalty:
        gate_line += f"    gate_spread_penalty: {spread_penalty}\n"
    if gate_floor:
        gate_line += f"    gate_floor: {gate_floor}\n"
    (run / "config.yaml").write_text(f"model:\n  attention: {attention}\n{gate_line}train:\n  seed: {seed}\n")
    if gates is not None:
        layers = [{"layer": i, "gate_mean": g, "gate_std": [0.1] * 3, "sel_distance_mean": 100.0,
                   "sel_forced_share": 0.5, "sel_concentration": 0.7} for i, g in enumerate(gates)]
        (run / "nsa_stats.jsonl").write_text(json.dumps({"step": 40, "layers": layers}) + "\n")
    if correct is not None:
        (run / "eval").mkdir()
        fields = ["task", "length", "depth", "samples", "accuracy"] if old_csv else runner.CSV_FIELDS
        with open(run / "eval" / "eval.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            for length, hits in correct.items():
                for depth, k in zip((0, 0.5, 1), hits):
                    low, high = wilson_interval(k, samples)
                    w.writerow({"task": "passkey", "length": length, "depth": depth, "samples": samples, "correct": k,
                                "accuracy": f"{k / samples:.4f}", "ci_low": low, "ci_high": high})
    return run


def test_compare_shows_the_seed_spread_the_margin_and_unused_branches(tmp_path):
    healthy = [[0.4, 0.5, 0.6], [0.3, 0.4, 0.5]]
    collapsed = [[0.01, 0.5, 0.6], [0.02, 0.4, 0.5]]
    runs = [
        fake_run(tmp_path, "nsa-s1", "nsa", 1, 2.00, healthy),
        fake_run(tmp_path, "nsa-s2", "nsa", 2, 2.10, collapsed),
        fake_run(tmp_path, "dense-s1", "dense", 1, 2.50),
        fake_run(tmp_path, "dense-s2", "dense", 2, 2.70),
    ]
    text = render_compare(runs, tmp_path / "out").read_text()
    assert "| nsa | 2 | 2 | 2.0500 | 2.0000 | 2.1000 | 0.1000 | 0.0707 |" in text
    assert "| dense | 2 | 2 | 2.6000 | 2.5000 | 2.7000 | 0.2000 | 0.1414 |" in text
    assert "NSA's mean validation loss is 0.5500 nats lower (better) than dense's" in text
    assert "The margin is larger than the widest spread between runs of one kind (0.2000)." in text
    assert "| nsa-s1 | 40 | 0.350 | 0.450 | 0.550 | yes |" in text
    assert f"| nsa-s2 | 40 | 0.015 | 0.450 | 0.550 | no (compressed below {USED_GATE}) |" in text
    assert "layer 0: compressed gate collapsed" in text
    assert "No run has retrieval results" in text and not (tmp_path / "out" / "retrieval_passkey.png").exists()


def test_compare_states_the_distribution_over_seeds_and_reruns(tmp_path, capsys):
    """Per attention kind: mean, min, max and spread over its runs, with how many runs and seeds (two folders of
    one seed are reruns), for the validation loss and for each task and length of retrieval."""
    runs = [
        # nsa: seed 1 twice (a rerun) and seed 2; at 128 tokens the runs score 3/12, 6/12 and 12/12.
        fake_run(tmp_path, "nsa-a", "nsa", 1, 2.00, correct={128: [0, 1, 2], 256: [0, 0, 4]}),
        fake_run(tmp_path, "nsa-b", "nsa", 1, 2.30, correct={128: [2, 2, 2]}),  # 256 skipped
        fake_run(tmp_path, "nsa-c", "nsa", 2, 2.10, correct={128: [4, 4, 4], 256: [4, 4, 4]}, old_csv=True),
        fake_run(tmp_path, "dense-a", "dense", 1, 2.50, correct={128: [4, 4, 3], 256: [4, 4, 4]}),
    ]
    out = tmp_path / "out"
    text = render_compare(runs, out).read_text()
    printed = capsys.readouterr().out
    assert "| nsa | 3 | 2 | 2.1333 | 2.0000 | 2.3000 | 0.3000 | 0.1528 |" in text
    assert "| dense | 1 | 1 | 2.5000 | 2.5000 | 2.5000 | one run | - |" in text
    assert "| nsa-a (nsa) | 0.25 (0.09-0.53) | 0.33 (0.14-0.61) |" in text  # each run, with its 95% interval
    assert "| nsa-b (nsa) | 0.50 (0.25-0.75) | - |" in text
    assert "| nsa | 128 | 3 | 2 | 0.58 | 0.25 | 1.00 | 0.75 |" in text
    assert "| nsa | 256 | 2 | 2 | 0.67 | 0.33 | 1.00 | 0.67 |" in text
    assert "| dense | 128 | 1 | 1 | 0.92 | 0.92 | 0.92 | one run |" in text
    assert re.search(r"^ *passkey 128 +nsa +3 +2 +0\.58 +0\.25 +1\.00 +0\.75$", printed, re.M)
    assert re.search(r"^ *val loss +nsa +3 +2 +2\.1333 +2\.0000 +2\.3000 +0\.3000$", printed, re.M)

    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert list(rows[0]) == ["metric", "task", "length", "attention", "runs", "seeds", "mean", "min", "max", "spread",
                             "std"]
    by_key = {(r["metric"], r["task"], r["length"], r["attention"]): r for r in rows}
    assert len(rows) == len(by_key) == 2 + 2 * 2
    nsa_128 = by_key[("exact_match", "passkey", "128", "nsa")]
    assert (nsa_128["runs"], nsa_128["seeds"]) == ("3", "2")
    assert [float(nsa_128[k]) for k in ("mean", "min", "max", "spread")] == pytest.approx([7 / 12, 0.25, 1.0, 0.75])
    assert by_key[("val_loss", "", "", "dense")]["std"] == ""  # one run: no standard deviation

    info = json.loads((out / "compare.json").read_text())
    assert info["exact_match"]["passkey"]["256"]["nsa"]["runs"] == 2
    assert info["val_loss"]["nsa"]["mean"] == pytest.approx(6.4 / 3)
    assert [(r["name"], r["seed"]) for r in info["runs"]] == [("nsa-a", 1), ("nsa-b", 1), ("nsa-c", 2), ("dense-a", 1)]
    assert [r["exact_match"]["passkey"]["128"] for r in info["runs"]] == pytest.approx([0.25, 0.5, 1.0, 11 / 12])


def test_compare_never_pools_nsa_runs_of_another_gate_function(tmp_path, capsys):
    runs = [fake_run(tmp_path, "sig", "nsa", 1, 2.0, gate="sigmoid"), fake_run(tmp_path, "soft", "nsa", 1, 1.0,
                                                                                gate="softmax"),
            fake_run(tmp_path, "dense", "dense", 1, 1.5)]
    text = render_compare(runs, tmp_path / "out").read_text()
    assert "| nsa | 1 | 1 | 2.0000 |" in text and "| nsa-softmax | 1 | 1 | 1.0000 |" in text
    assert "NSA's mean validation loss is 0.5000 nats higher" in text
    assert "NSA (nsa-softmax)'s mean validation loss is 0.5000 nats lower" in text


def test_compare_keeps_runs_with_the_gate_spread_penalty_or_floor_apart(tmp_path):
    runs = [fake_run(tmp_path, "soft", "nsa", 1, 1.0, gate="softmax"),
            fake_run(tmp_path, "spread", "nsa", 1, 0.5, gate="softmax", spread_penalty=0.01),
            fake_run(tmp_path, "floor", "nsa", 1, 0.25, gate="softmax", gate_floor=0.02)]
    text = render_compare(runs, tmp_path / "out").read_text()
    assert "| nsa-softmax | 1 | 1 | 1.0000 |" in text and "| nsa-softmax-spread0.01 | 1 | 1 | 0.5000 |" in text
    assert "| nsa-softmax-floor0.02 | 1 | 1 | 0.2500 |" in text


def test_compare_keeps_runs_of_other_model_settings_apart_and_pools_the_same_settings(tmp_path):
    def run(name, seed, val, extra):
        path = fake_run(tmp_path, name, "nsa", seed, val, gate="softmax")
        config = path / "config.yaml"
        config.write_text(config.read_text().replace("    gate: softmax\n", f"    gate: softmax\n{extra}"))
        return path

    runs = [run("w128a", 1, 1.0, "    window: 128\n"), run("w128b", 2, 0.5, "    window: 128\n"),
            run("w512", 1, 0.25, "    window: 512\n"), run("w512-triton", 2, 0.75, "    window: 512\n    backend: triton\n"),
            fake_run(tmp_path, "dense", "dense", 1, 0.1)]
    text = render_compare(runs, tmp_path / "out").read_text()
    assert "| nsa-softmax-window128 | 2 | 2 | 0.7500 |" in text  # the two 128-token runs pooled
    assert "| nsa-softmax-window512 | 2 | 2 | 0.5000 |" in text  # a kernel choice is not a variant
    assert "| dense | 1 | 1 | 0.1000 |" in text  # a dense run's NSA settings never count
    same = render_compare(runs[:2], tmp_path / "same").read_text()
    assert "| nsa-softmax | 2 | 2 | 0.7500 |" in same  # nothing differs: no suffix


def test_compare_gives_the_margin_in_percent_only_where_dense_loss_is_not_near_zero(tmp_path):
    lm = [fake_run(tmp_path, "lm-nsa", "nsa", 1, 1.1), fake_run(tmp_path, "lm-dense", "dense", 1, 1.0)]
    assert "0.1000 nats higher (worse) than dense's (+10.00%)." in render_compare(lm, tmp_path / "lm").read_text()
    solved = [fake_run(tmp_path, "ret-nsa", "nsa", 1, 0.003), fake_run(tmp_path, "ret-dense", "dense", 1, 1e-6)]
    text = render_compare(solved, tmp_path / "ret").read_text()
    assert "0.0030 nats higher (worse) than dense's." in text and "%)" not in text.split("**Margin:**")[1]


# ------------------------------------------------------------------------------------------- errors


def nsa_cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsa", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_user_errors_exit_2_with_one_line(runs, tmp_path, capsys):
    cases = [
        (["eval", str(tmp_path / "missing")], "does not exist"),
        (["eval", str(tmp_path)], "no complete checkpoint"),
        (["eval", str(runs / "nsa"), "--lengths", "4k,8192"], "--lengths: '4k' is not an integer"),
        (["eval", str(runs / "nsa"), "--depths", "0,1.5"], "--depths: 1.5 is outside [0, 1]"),
        (["eval", str(runs / "nsa"), "--tasks", "passkey,needle"], "--tasks: unknown task 'needle'"),
        (["eval", str(runs / "nsa"), "train.steps=3"], "overrides of the data section only"),
        (["eval", str(runs / "nsa"), "data.retrieval.kv_pairs=0"], "data.retrieval.kv_pairs must be >= 1"),
        (["compare", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "does not exist"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("nsa: error: ") and message in err, (args, err)
        assert err.strip().count("\n") == 0, err
    # The same through the process boundary: exit status 2, one line, no traceback.
    out = nsa_cli("eval", str(tmp_path / "missing"))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert out.stderr.startswith("nsa: error: ") and "does not exist" in out.stderr


def test_retrieval_heatmaps_of_many_runs_wrap_into_rows(tmp_path):
    from matplotlib.image import imread

    from nsa.eval.grid import Grid
    from nsa.plots.retrieval import GRIDS_PER_ROW, plot_grids

    def grids(n):
        return [Grid(f"run {i}", [16384, 32768], [0.0, 0.5, 1.0], np.full((3, 2), 0.9)) for i in range(n)]

    one_row = imread(plot_grids(grids(GRIDS_PER_ROW), tmp_path / "one.png")).shape
    two_rows = imread(plot_grids(grids(GRIDS_PER_ROW + 2), tmp_path / "two.png")).shape
    assert two_rows[1] == one_row[1]  # no wider than a full row
    assert two_rows[0] == pytest.approx(2 * one_row[0], rel=0.02)
