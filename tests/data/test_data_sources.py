"""Data sources beyond the embedded corpus: jsonl/parquet streams, shards, synthetic data, tokenizers,
exact position resume for each, prefetch and its first-batch timeout, and the errors."""

import json
import time

import numpy as np
import pytest
import torch

from nsa.cli import main
from nsa.config import load_config
from nsa.data.config import DataConfig
from nsa.data.loader import Prefetcher, StreamBatches, SyntheticBatches, WindowBatches, build_data
from nsa.data.prepare import prepare
from nsa.data.shards import ShardWindows, load_meta, read_shard
from nsa.data.tokenizers import ByteTokenizer, get_tokenizer
from nsa.errors import UserError
from nsa.train.loop import train

DOCS = [f"Document number {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 5) for i in range(60)]


@pytest.fixture
def jsonl_dir(tmp_path):
    folder = tmp_path / "jsonl"
    folder.mkdir()
    for part in range(3):
        with open(folder / f"part{part}.jsonl", "w") as f:
            for doc in DOCS[part::3]:
                f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    return folder


@pytest.fixture
def parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS}), path, row_group_size=7)
    return path


def drain(stream, n):
    return [stream.next_batch()[0].clone() for _ in range(n)]


def assert_resumes_exactly(make_stream, n_before=3, n_after=5):
    stream = make_stream()
    drain(stream, n_before)
    state = json.loads(json.dumps(stream.state_dict(), default=lambda o: o.tolist()))  # survives serialisation
    expected = drain(stream, n_after)
    resumed = make_stream()
    resumed.load_state_dict(state)
    got = drain(resumed, n_after)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_jsonl_stream_packs_documents_and_resumes_exactly(jsonl_dir):
    cfg = DataConfig(source="jsonl", path=str(jsonl_dir), val_fraction=0.1)
    stream = StreamBatches(cfg, ByteTokenizer(), 32, 2, 0, 1, "train")
    x, y = stream.next_batch()
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert_resumes_exactly(lambda: StreamBatches(cfg, ByteTokenizer(), 32, 2, 0, 1, "train"))


def test_parquet_stream_with_another_text_field_resumes_exactly(parquet_file):
    cfg = DataConfig(source="parquet", path=str(parquet_file), text_field="content")
    assert_resumes_exactly(lambda: StreamBatches(cfg, ByteTokenizer(), 48, 3, 0, 1, "train"), 4, 6)
    bad = DataConfig(source="parquet", path=str(parquet_file))
    with pytest.raises(UserError, match=r"data.text_field='text' is not a field of the records \(fields: content\)"):
        StreamBatches(bad, ByteTokenizer(), 48, 3, 0, 1, "train").next_batch()


def test_stream_ranks_read_disjoint_documents_and_validation_is_held_out(jsonl_dir):
    cfg = DataConfig(source="jsonl", path=str(jsonl_dir), val_fraction=0.25)
    tok = ByteTokenizer()

    def docs_seen(rank, world, split):
        stream = StreamBatches(cfg, tok, 2000, 1, rank, world, split)
        text = tok.decode(stream.next_batch()[0][0].tolist())
        return {int(part.split(":")[0]) for part in text.split("Document number ")[1:] if ":" in part[:4]}

    r0, r1 = docs_seen(0, 2, "train"), docs_seen(1, 2, "train")
    assert r0 and r1 and not r0 & r1
    assert not docs_seen(0, 1, "val") & docs_seen(0, 1, "train")


def test_window_and_synthetic_batches_resume_exactly():
    from nsa.data.packing import TokenWindows

    windows = TokenWindows(np.arange(1000), seq_len=16)
    assert_resumes_exactly(lambda: WindowBatches(windows, 4, seed=1, rank=1, world=2), 20, 30)  # across epochs
    assert_resumes_exactly(lambda: SyntheticBatches(100, 16, 4, seed=1, rank=1))
    a, b = SyntheticBatches(100, 16, 4, seed=1, rank=0), SyntheticBatches(100, 16, 4, seed=1, rank=1)
    assert not torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_prepare_writes_shards_that_train_and_resume(tmp_path):
    cfg = load_config(None, ["data.val_fraction=0.1"])
    meta = prepare(cfg.data, str(tmp_path / "shards"), shard_tokens=200_000, max_documents=300, progress=False)
    assert meta["tokenizer"] == "byte" and meta["splits"]["train"]["shards"] >= 2
    assert meta["splits"]["val"]["documents"] == 30
    tokens, header = read_shard(next((tmp_path / "shards").glob("train_00000.bin")))
    assert tokens.dtype == np.uint16 and header["eot_id"] == 256 and (np.asarray(tokens) == 256).sum() > 0
    total = sum(len(read_shard(p)[0]) for p in (tmp_path / "shards").glob("train_*.bin"))
    assert total == meta["splits"]["train"]["tokens"] == load_meta(str(tmp_path / "shards"))["splits"]["train"]["tokens"]
    windows = ShardWindows(str(tmp_path / "shards"), "train", 64)
    assert_resumes_exactly(lambda: WindowBatches(windows, 4, seed=3), 10, 10)
    result = train(load_config(None, [
        "data.source=shards", f"data.path={tmp_path / 'shards'}", "train.steps=30", "train.seq_len=64",
        "model.n_layers=2", "model.dim=64", "model.head_dim=16", "model.mlp_hidden=128", "train.progress=false",
        "train.sample_tokens=0", "train.eval_every=30", f"train.out_dir={tmp_path / 'runs'}"]))
    assert result.last_loss < result.first_loss - 1.0 and result.val_loss is not None
    with pytest.raises(UserError, match="is not empty"):
        prepare(cfg.data, str(tmp_path / "shards"))
    with pytest.raises(UserError, match="were made with the 'byte' tokenizer; set data.tokenizer=byte"):
        build_data(DataConfig(source="shards", path=str(tmp_path / "shards"), tokenizer="gpt2"),
                   get_tokenizer("gpt2"), 64, 2, 1, 0)


@pytest.mark.parametrize("documents,val_fraction,val", [(1, 0.05, 0), (2, 0.05, 1), (4, 0.05, 1), (19, 0.05, 1),
                                                         (40, 0.05, 2), (41, 0.05, 2), (4, 0.0, 0), (10, 0.5, 5)])
def test_prepare_holds_out_a_validation_document_whenever_it_can(tmp_path, documents, val_fraction, val, capsys):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(documents):
        (folder / f"{i:03d}.txt").write_text(f"document {i}\n")
    assert main(["prepare", "data.source=text", f"data.path={folder}", f"data.val_fraction={val_fraction}",
                 "--out", str(tmp_path / "shards")]) == 0
    meta = load_meta(str(tmp_path / "shards"))["splits"]
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (documents - val, val)
    assert f"val: {val} documents" in capsys.readouterr().out
    held_out = [] if not val else read_shard(tmp_path / "shards" / "val_00000.bin")[0]
    text = bytes(int(t) for t in held_out if t < 256).decode()
    if val and documents < round(1 / val_fraction):  # too few for the stride: the last document
        assert text == f"document {documents - 1}\n"


def test_prefetch_serves_batches_in_order_with_the_state_of_the_last_one_handed_out():
    reference = SyntheticBatches(50, 8, 2, seed=5)
    pre = Prefetcher(SyntheticBatches(50, 8, 2, seed=5), depth=3, first_batch_timeout_s=10, source="synthetic")
    for handed_out in range(1, 4):
        assert torch.equal(pre.next_batch()[0], reference.next_batch()[0])
        time.sleep(0.05)  # the thread prepares batches ahead meanwhile
        assert pre.state_dict() == {"counter": handed_out}
    pre.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetch_hands_out_contiguous_copies_and_pins_only_for_a_gpu(depth):
    """The synthetic stream returns strided views (x = rows[:, :-1]); copying those to a GPU cost the training
    thread a CPU copy each step. The prefetcher makes them contiguous off that thread."""
    reference = SyntheticBatches(50, 8, 2, seed=5)
    pre = Prefetcher(SyntheticBatches(50, 8, 2, seed=5), depth=depth, first_batch_timeout_s=10, source="synthetic")
    assert not reference.next_batch()[0].is_contiguous()
    pre.pin_for(torch.device("cpu"))
    x, y = pre.next_batch()
    want_x, want_y = SyntheticBatches(50, 8, 2, seed=5).next_batch()
    assert x.is_contiguous() and y.is_contiguous() and not x.is_pinned()
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    with pytest.raises(RuntimeError, match="before the first batch"):
        pre.pin_for(torch.device("cpu"))
    pre.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_prefetch_pins_batches_for_a_gpu_so_the_copy_is_queued():
    pre = Prefetcher(SyntheticBatches(50, 8, 2, seed=5), depth=2, first_batch_timeout_s=10, source="synthetic")
    pre.pin_for(torch.device("cuda", torch.cuda.current_device()))
    x, y = pre.next_batch()
    assert x.is_pinned() and y.is_pinned() and x.is_contiguous()
    assert torch.equal(x.cuda(non_blocking=True).cpu(), SyntheticBatches(50, 8, 2, seed=5).next_batch()[0])
    pre.close()


def test_close_waits_for_the_batch_in_hand_so_the_process_exits_cleanly():
    # A producer thread left inside torch at interpreter exit aborted 1 in 4 finished runs (exit 134).
    class Slow(SyntheticBatches):
        def next_batch(self):
            time.sleep(0.3)
            return super().next_batch()

    pre = Prefetcher(Slow(50, 8, 2, seed=5), depth=1, first_batch_timeout_s=10, source="synthetic")
    pre.next_batch()  # the thread is now producing the next batch (0.3 s)
    pre.close()
    assert not pre._thread.is_alive()


def test_a_source_that_never_delivers_times_out_with_a_clear_message():
    class Stuck:
        def next_batch(self):
            time.sleep(30)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    pre = Prefetcher(Stuck(), depth=2, first_batch_timeout_s=0.5, source="hf://nowhere")
    with pytest.raises(UserError, match=r"no training batch from data source 'hf://nowhere' after 0s "
                                        r"\(data.first_batch_timeout_s\)"):
        pre.next_batch()


def test_an_unreachable_hub_dataset_is_a_one_line_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # The hub client's own offline switch (read at import): fail at once instead of ~20 s of retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    cfg = DataConfig(source="hf", hf_name="HuggingFaceFW/fineweb-edu", hf_config="sample-10BT")
    with pytest.raises(UserError, match="could not open data source 'HuggingFaceFW/fineweb-edu'") as info:
        build_data(cfg, ByteTokenizer(), 64, 2, 1, 0)
    assert "\n" not in str(info.value) and "nsa prepare" in str(info.value)


def test_gpt2_tokenizer_is_the_real_gpt2_offline():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world").tolist() == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.decode(tok.encode("In the beginning — God")) == "In the beginning — God"
    with pytest.raises(UserError, match="is not a file"):
        get_tokenizer("gpt2", "/no/such/ranks")


def test_hf_tokenizer_from_a_local_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = get_tokenizer("hf", str(tmp_path / "tokenizer.json"))
    assert ours.eot_id == tok.token_to_id("</s>")
    ids = ours.encode("the quick brown fox")
    assert len(ids) > 0 and ours.decode(ids).replace(" ", "") == "thequickbrownfox"
    with pytest.raises(UserError, match="needs data.tokenizer_path"):
        get_tokenizer("hf", "")
