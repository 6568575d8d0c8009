"""Tokenizer, sources, packing, splits and the resumable batch order."""

import numpy as np
import pytest

from nsa.data.config import DataConfig
from nsa.data.loader import WindowBatches
from nsa.data.packing import TokenWindows, build_splits, pack, split_documents
from nsa.data.sources import embedded_corpus, text_files
from nsa.data.tokenizers import ByteTokenizer, get_tokenizer, padded_vocab_size
from nsa.cli import main
from nsa.errors import ConfigError, UserError


def test_byte_tokenizer_round_trips_unicode():
    tok = get_tokenizer("byte")
    text = "In the beginning — ἐν ἀρχῇ ✓"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text
    assert tok.decode([*ids[:3], tok.eot_id]) == text[:3]
    assert padded_vocab_size(tok.vocab_size) == 320
    with pytest.raises(ConfigError, match="unknown"):
        get_tokenizer("sentencepiece")


def test_embedded_corpus_is_real_english_split_into_chapters():
    docs = list(embedded_corpus())
    assert len(docs) == 1189
    assert docs[0].startswith("Genesis 1\n") and "In the beginning God created" in docs[0]
    assert sum(map(len, docs)) > 4_000_000


def test_pack_puts_end_of_text_between_documents_and_truncates_nothing():
    tok = ByteTokenizer()
    docs = ["abc", "de", "f"]
    stream = pack(docs, tok)
    assert stream.tolist() == [97, 98, 99, 256, 100, 101, 256, 102, 256]


def test_validation_documents_are_held_out_and_spread():
    docs = [f"doc{i}" for i in range(40)]
    train, val = split_documents(docs, 0.1)
    assert val == [f"doc{i}" for i in range(9, 40, 10)]
    assert not set(train) & set(val) and len(train) + len(val) == 40


def test_windows_give_shifted_targets():
    windows = TokenWindows(np.arange(50), seq_len=8)
    assert len(windows) == 6  # (50 - 1) // 8
    x, y = windows.batch([0, 5])
    assert x[0].tolist() == list(range(8)) and y[0].tolist() == list(range(1, 9))
    assert x[1].tolist() == list(range(40, 48)) and y[1].tolist() == list(range(41, 49))


def test_batches_cover_each_window_once_per_epoch_split_over_ranks_and_resume_exactly():
    windows = TokenWindows(np.arange(10 * 4 + 1), seq_len=4)  # 10 windows; window i starts at token 4i
    firsts = lambda batch: (batch[0][:, 0] // 4).tolist()  # noqa: E731
    one = WindowBatches(windows, batch_size=2, seed=4)
    epoch = [i for _ in range(5) for i in firsts(one.next_batch())]
    assert sorted(epoch) == list(range(10))
    # Two ranks with half the batch see the same global batches, split between them.
    ranks = [WindowBatches(windows, batch_size=1, seed=4, rank=r, world=2) for r in range(2)]
    assert [i for _ in range(5) for r in ranks for i in firsts(r.next_batch())] == epoch
    state = one.state_dict()
    expected = [firsts(one.next_batch()) for _ in range(7)]
    resumed = WindowBatches(windows, batch_size=2, seed=4)
    resumed.load_state_dict(state)
    assert [firsts(resumed.next_batch()) for _ in range(7)] == expected


def test_text_files_source_reads_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 200)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta " * 200)
    (tmp_path / "skip.md").write_text("not text")
    assert [d[:5] for d in text_files(str(tmp_path))] == ["alpha", "beta "]
    # Two documents are too few to hold one out at val_fraction 0.1: the stream's tail is held out.
    train, val = build_splits(DataConfig(source="text", path=str(tmp_path), val_fraction=0.1), ByteTokenizer(), 32)
    assert len(train.tokens) + len(val.tokens) == 1200 + 1000 + 2


def test_source_errors_are_one_line_and_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        list(text_files(str(tmp_path / "missing")))
    with pytest.raises(UserError, match="holds no .txt files"):
        list(text_files(str(tmp_path)))
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(UserError, match="fewer than one window"):
        build_splits(DataConfig(source="text", path=str(tmp_path), val_fraction=0), ByteTokenizer(), 64)


def test_binary_files_are_skipped_and_undecodable_bytes_counted_once(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 na\xefve " * 10 + b"\xff\xfe tail")  # Latin-1, not UTF-8
    (tmp_path / "c.txt").write_bytes(bytes(range(256)) * 4)  # binary: NUL bytes among others
    (tmp_path / "d.txt").write_text("hello", encoding="utf-16")  # NUL bytes too
    (tmp_path / "e.txt").write_text("delta " * 50)
    out = tmp_path / "shards"
    assert main(["prepare", "data.source=text", f"data.path={tmp_path}", "--out", str(out)]) == 0
    err = [line.strip() for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert err == [
        f"warning: data.path '{tmp_path}': skipped 2 of 5 .txt files holding NUL bytes (binary, or UTF-16/32 text; "
        "convert text to UTF-8 to train on it)",
        f"warning: data.path '{tmp_path}': 22 bytes in 1 of 5 .txt files are not UTF-8 and were replaced by U+FFFD "
        "(convert those files to UTF-8)",
    ]
    docs = list(text_files(str(tmp_path)))
    assert [d[:5] for d in docs] == ["alpha", "caf\ufffd ", "delta"] and docs[1].count("\ufffd") == 22
    capsys.readouterr()


def test_a_folder_of_binary_files_alone_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    assert main(["train", "data.source=text", f"data.path={tmp_path}", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"nsa: error: data.path '{tmp_path}': all 1 .txt file(s) hold NUL bytes (binary, or UTF-16/32 "
                   "text); give UTF-8 text files\n")


def test_clean_text_trains_without_a_warning(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("In the beginning — ἐν ἀρχῇ ✓ " * 50)
    assert len(list(text_files(str(tmp_path)))) == 1
    assert capsys.readouterr().err == ""
