"""Document boundaries of batches (data.document_masking): found from end-of-text, padded to a static shape,
carried through every source, the prefetcher and a resume."""

import json

import numpy as np
import pytest
import torch

from nsa.data.boundaries import eot_boundaries, row_boundaries
from nsa.data.config import DataConfig, RetrievalConfig
from nsa.data.loader import Prefetcher, WindowBatches, WithBoundaries, build_data, split_batch
from nsa.data.packing import TokenWindows
from nsa.data.tokenizers import ByteTokenizer
from nsa.errors import ConfigError
from nsa.config import load_config
from nsa.model.documents import Documents

EOT = ByteTokenizer().eot_id


def test_a_document_starts_at_each_row_and_after_each_end_of_text():
    x = torch.tensor([[5, EOT, 6, EOT],  # ends with end-of-text: the next row starts right after it
                      [EOT, 8, EOT, 9],  # starts with the end-of-text of a document begun in another window
                      [1, 2, 3, 4]])  # one document
    cu = eot_boundaries(x, EOT)
    starts = [0, 2, 4, 5, 7, 8]  # row 1: its start, then after each end-of-text; row 2: its start only
    assert cu.dtype == torch.int32 and cu.shape == (13,)
    assert cu.tolist() == starts + [12] * (13 - len(starts))
    # The end-of-text belongs to the document it ends; positions restart right after it.
    docs = Documents.from_cu_seqlens(cu, 3, 4)
    assert docs.positions.tolist() == [[0, 1, 0, 1], [0, 0, 1, 0], [0, 1, 2, 3]]


def test_a_window_of_one_document_and_a_batch_of_end_of_text_tokens():
    assert eot_boundaries(torch.tensor([[1, 2, 3, 4, 5]]), EOT).tolist() == [0, 5, 5, 5, 5, 5]
    # Every token a document: the padded length is exactly enough.
    assert eot_boundaries(torch.full((2, 3), EOT), EOT).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_rows_of_one_example_each_are_cut_at_the_row_starts():
    assert row_boundaries(torch.zeros(3, 4, dtype=torch.long)).tolist() == [0, 4, 8] + [12] * 10


def _data(source: str, masking, seq_len: int = 64, **data):
    cfg = DataConfig(source=source, document_masking=masking, prefetch=0, **data)
    return build_data(cfg, ByteTokenizer(), seq_len=seq_len, batch_size=4, eval_batches=2, seed=3)


def test_every_training_and_validation_batch_carries_boundaries_of_one_static_shape():
    data = _data("embedded", "auto", seq_len=2048)  # chapters of a few thousand bytes: a few in each batch
    batches = [data.train.next_batch() for _ in range(6)] + data.val
    counts = set()
    for batch in batches:
        x, y, cu = split_batch(batch)
        assert cu.shape == (4 * 2048 + 1,) and cu.dtype == torch.int32
        assert cu.tolist() == eot_boundaries(x, EOT).tolist()
        counts.add(int((cu[1:] > cu[:-1]).sum()))  # documents in the batch
    assert len(counts) > 1 and min(counts) > 4  # the padding hides a count that varies, past the rows
    assert "masked per document" in data.description


def test_retrieval_batches_are_one_document_a_row_at_every_mixed_length():
    retrieval = RetrievalConfig(mix_lengths=[256, 512])
    data = _data("retrieval", "auto", seq_len=128, retrieval=retrieval)
    shapes = set()
    for _ in range(8):
        x, _, cu = split_batch(data.train.next_batch())
        shapes.add(tuple(x.shape))
        assert cu.shape == (513,) and cu.tolist() == row_boundaries(x).tolist()
    assert len(shapes) > 1


def test_masking_off_gives_the_sources_batches_unchanged():
    plain = _data("embedded", False)
    masked = _data("embedded", True)
    assert all(len(batch) == 2 for batch in plain.val)
    for a, b in zip([plain.train.next_batch() for _ in range(3)] + plain.val,
                    [masked.train.next_batch() for _ in range(3)] + masked.val):
        assert len(a) == 2 and len(b) == 3
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert "masked" not in plain.description


def test_a_streamed_source_is_cut_where_its_documents_start(tmp_path):
    docs = [f"Document {i}: " + "words " * (i % 7) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = _data("jsonl", "auto", path=str(tmp_path / "docs.jsonl"))
    tok = ByteTokenizer()
    x, _, cu = split_batch(data.train.next_batch())
    flat = x.flatten().tolist()
    starts = [int(s) for s in cu.unique() if 0 < s % x.shape[1] < x.shape[1] - 9]  # within a row
    assert len(starts) > 4
    assert all(tok.decode(flat[s:s + 9]) == "Document " for s in starts)


@pytest.mark.parametrize("source,on", [("embedded", True), ("shards", True), ("jsonl", True), ("hf", True),
                                       ("retrieval", True), ("synthetic", False)])
def test_auto_masks_every_source_of_documents_and_not_random_tokens(source, on):
    assert DataConfig(source=source).masks_documents() is on
    assert DataConfig(source=source, document_masking=not on).masks_documents() is not on


def test_document_masking_takes_true_false_or_auto():
    assert load_config(None, ["data.document_masking=false"]).data.document_masking is False
    with pytest.raises(ConfigError, match=r"data.document_masking='maybe' is not valid: expected true or false or"):
        load_config(None, ["data.document_masking=maybe"])


@pytest.mark.parametrize("depth", [0, 2])
def test_the_prefetcher_resumes_a_masked_stream_exactly(depth):
    windows = TokenWindows(np.tile(np.array([1, 2, EOT, 3, 4, 5, EOT]), 20), seq_len=8)
    stream = lambda: WithBoundaries(WindowBatches(windows, batch_size=2, seed=1), lambda x: eot_boundaries(x, EOT))  # noqa: E731
    first = Prefetcher(stream(), depth, 10, "test")
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    expected = [first.next_batch() for _ in range(6)]
    first.close()
    resumed = Prefetcher(stream(), depth, 10, "test")
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert len(got) == 3 and all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(want, got))
    resumed.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_the_boundaries_are_pinned_with_the_batch_for_a_gpu():
    windows = TokenWindows(np.tile(np.array([1, 2, EOT]), 40), seq_len=8)
    pre = Prefetcher(WithBoundaries(WindowBatches(windows, 2, seed=1), lambda x: eot_boundaries(x, EOT)), 2, 10, "t")
    pre.pin_for(torch.device("cuda", torch.cuda.current_device()))
    x, y, cu = pre.next_batch()
    assert x.is_pinned() and y.is_pinned() and cu.is_pinned() and cu.is_contiguous()
    assert cu.to("cuda", non_blocking=True).tolist() == eot_boundaries(x, EOT).tolist()
    pre.close()
