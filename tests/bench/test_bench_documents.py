"""`nsa bench attention --docs`: the mixture specs, the packed layouts built from a mixture (cu_seqlens, FlexAttention's
document mask, jagged tensors), a row's times and ratios (the timing replaced by recorders: it needs a GPU), and the
command line on a machine without one."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

import nsa.bench.attention as bench
from nsa.bench.mixtures import (Mixture, cu_seqlens, document_block_mask, document_ids, draw_lengths, jagged,
                                parse_mixture, parse_mixtures)
from nsa.cli import main
from nsa.errors import UserError

TINY = Mixture("tiny", (5, 1, 7, 3))
"""Documents of one token, of lengths off any block size, and a last one shorter than the rest."""


def written_out_mask(lengths) -> torch.Tensor:
    """[T, T]: query t sees key s when s <= t in t's document, one causal block per document."""
    return torch.block_diag(*(torch.ones(n, n, dtype=torch.bool).tril() for n in lengths))


# ------------------------------------------------------------------------------------------------ the specs


def test_a_range_fills_the_total_with_lengths_inside_it_and_cuts_the_last():
    mixture = parse_mixture("64k:1k-32k")
    assert mixture.total == sum(mixture.lengths) == 65536 and mixture.spec == "64k:1k-32k"
    *whole, last = mixture.lengths
    assert len(whole) >= 2 and all(1024 <= n <= 32768 for n in whole)
    assert 1 <= last <= 32768
    assert len(set(whole)) > 1  # drawn, not one length repeated


def test_one_length_repeats_and_the_last_document_is_cut_to_fit():
    assert parse_mixture("64k:2k").lengths == (2048,) * 32
    assert parse_mixture("10000:3000").lengths == (3000, 3000, 3000, 1000)
    assert parse_mixture("8k:8k").lengths == (8192,)
    assert parse_mixture("8K:8192").lengths == (8192,)


def test_the_draw_is_fixed_by_its_seed():
    assert parse_mixture("64k:1k-32k").lengths == parse_mixture("64k:1k-32k@0").lengths
    assert parse_mixture("64k:1k-32k@3").lengths == parse_mixture("64k:1k-32k@3").lengths
    assert parse_mixture("64k:1k-32k@3").lengths != parse_mixture("64k:1k-32k@4").lengths
    assert draw_lengths(1 << 20, 1024, 32768, seed=7) == draw_lengths(1 << 20, 1024, 32768, seed=7)


def test_draws_favour_short_documents_log_uniformly():
    lengths = draw_lengths(1 << 24, 1024, 32768, seed=1)[:-1]
    short = sum(n < 2048 for n in lengths)
    long = sum(n >= 16384 for n in lengths)
    assert abs(short - long) < 0.25 * len(lengths) / 5  # one octave each: equally likely
    assert sum(n < 16384 for n in lengths) > 3 * long  # where a uniform draw would give about 1x


@pytest.mark.parametrize("spec, message", [
    ("64k", "is not TOTAL:LENGTH or TOTAL:MIN-MAX"),
    ("64k:1k-", "is not TOTAL:LENGTH or TOTAL:MIN-MAX"),
    ("64k:1k-32k@x", "is not TOTAL:LENGTH or TOTAL:MIN-MAX"),
    ("64k:-2k", "is not TOTAL:LENGTH or TOTAL:MIN-MAX"),
    ("64m:2k", "'64m' is not a positive size"),
    ("0:2k", "'0' is not a positive size"),
    ("64k:0-2k", "'0' is not a positive size"),
    ("64k:2.5k", "is not TOTAL:LENGTH"),
    ("64k:4k-2k", "shortest length 4096 exceeds the longest 2048"),
    ("1k:2k", "documents of up to 2048 tokens do not fit in 1024"),
])
def test_bad_specs_are_refused_naming_the_spec_and_the_fix(spec, message):
    with pytest.raises(UserError, match=message) as e:
        parse_mixture(spec)
    assert f"'{spec}'" in str(e.value) and "\n" not in str(e.value)


def test_several_specs_are_comma_separated_and_none_is_refused():
    assert [m.spec for m in parse_mixtures("64k:2k,64k:1k-32k")] == ["64k:2k", "64k:1k-32k"]
    with pytest.raises(UserError, match="at least one document mixture"):
        parse_mixtures(",")


# ---------------------------------------------------------------------------------------------- the layouts


def test_cu_seqlens_are_the_running_sums_of_the_lengths():
    cu = cu_seqlens(TINY)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 13, 16]
    assert document_ids(TINY).tolist() == [0] * 5 + [1] + [2] * 7 + [3] * 3


def test_the_block_mask_is_causal_within_each_document():
    mask = document_block_mask(TINY, "cpu", block_size=4)
    dense = create_mask(mask.mask_mod, 1, 1, TINY.total, TINY.total, device="cpu")[0, 0]
    expected = written_out_mask(TINY.lengths)
    assert torch.equal(dense, expected)
    # A 4x4 tile is computed exactly where some query in it sees some key in it.
    tiles = expected.view(4, 4, 4, 4).any(3).any(1)
    assert torch.equal(mask.to_dense()[0, 0].bool(), tiles)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_with_the_block_mask_attends_within_documents():
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, TINY.total, 8, generator=g) for n in (4, 2, 2))
    out = flex_attention(q, k, v, block_mask=document_block_mask(TINY, "cpu", block_size=4), enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=written_out_mask(TINY.lengths), enable_gqa=True)
    torch.testing.assert_close(out, expected)


def test_jagged_tensors_hold_one_document_each_and_pass_gradients_to_the_packed_values():
    values = torch.randn(TINY.total, 3, 8, requires_grad=True)
    nested = jagged(values, TINY)
    parts = nested.unbind()
    assert [p.shape for p in parts] == [torch.Size([3, n, 8]) for n in TINY.lengths]
    for part, start, n in zip(parts, cu_seqlens(TINY).tolist(), TINY.lengths):
        assert torch.equal(part, values[start:start + n].transpose(0, 1))
    (nested.transpose(1, 2).values() * torch.arange(TINY.total)[:, None, None]).sum().backward()
    assert torch.equal(values.grad[:, 0, 0], torch.arange(TINY.total, dtype=torch.float32))


# ------------------------------------------------------------------------------------- a row of the table


@pytest.fixture
def recorded(monkeypatch):
    """compare_documents with every call a name and every time looked up; cuDNN's varlen kernel refuses."""
    monkeypatch.setattr(bench, "make_inputs", lambda *args, **kwargs: ["ins"])
    monkeypatch.setattr(bench, "cu_seqlens", lambda mixture, device: torch.zeros(2, dtype=torch.int32))
    monkeypatch.setattr(bench, "_nsa", lambda ins: "unpacked")
    monkeypatch.setattr(bench, "_nsa_packed", lambda ins, cu: "nsa")
    monkeypatch.setattr(bench, "_flex", lambda ins, mixture: ("flex", []))
    monkeypatch.setattr(bench, "_varlen", lambda ins, mixture, backend: (backend, []))
    monkeypatch.setattr(bench, "_flash_varlen", lambda ins, mixture: ("flash", []))
    monkeypatch.setattr(bench, "_fla", lambda ins, cu=None: ("fla", []) if cu is not None else None)
    monkeypatch.setattr(bench, "_fwd_bwd", lambda forward, tensors: forward + "+bwd")
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    times = {"nsa": 2.0, "unpacked": 3.0, "flex": 4.0, "flash": 5.0, "fla": 8.0}
    monkeypatch.setattr(bench, "_time_as", lambda fn, graphs: times[fn.split("+")[0]])

    def measure(fn, graphs, kernel=""):
        if fn.startswith("cudnn"):
            return None, f"No available kernel; {kernel} refused"
        return times[fn.split("+")[0]], None

    monkeypatch.setattr(bench, "_measure", measure)


def test_a_row_gives_each_reference_over_nsa_and_why_one_did_not_run(recorded):
    row = bench.compare_documents("paper", parse_mixture("8k:2k"), backward=True, use_fla=True)
    assert (row["docs"], row["n"], row["T"]) == ("8k:2k", 4, 8192)
    for kind in ("fwd", "fwdbwd"):
        assert row[f"nsa_{kind}_ms"] == 2.0
        assert [row[f"vs_{who}_{kind}"] for who in ("unpacked", "flex", "flash", "fla")] == [1.5, 2.0, 2.5, 4.0]
        assert row[f"cudnn_{kind}_ms"] == "n/a" and row[f"vs_cudnn_{kind}"] == "n/a"
    assert row["not_run"] == ("cudnn fwd: No available kernel; cuDNN attention refused | "
                              "cudnn fwdbwd: No available kernel; cuDNN attention refused")


def test_forward_only_rows_have_no_backward_columns(recorded):
    row = bench.compare_documents("m7c", parse_mixture("8k:2k"), backward=False, use_fla=False)
    assert row["vs_flex_fwd"] == 2.0 and "fla_fwd_ms" not in row and row["vs_fla_fwd"] is None
    assert not any("fwdbwd" in key for key in row)


def test_sdpa_reasons_are_those_of_the_kernel_asked_for():
    told = ["Memory efficient kernel not used because:", "head dim too large",
            "Flash attention kernel not used because:", "Flash attention runtime disabled",
            "cuDNN attention kernel not used because:", "cuDNN needs contiguous ragged offsets"]
    assert bench.refusal_of(told, "cuDNN attention") == ["cuDNN needs contiguous ragged offsets"]
    assert bench.refusal_of(["a reason"], "Flash attention") == ["a reason"]


# ------------------------------------------------------------------------------------------- the command


def test_the_command_checks_the_specs_then_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert main(["bench", "attention", "--docs", "64k:1k-32k@x"]) == 2
    assert capsys.readouterr().err == (
        "nsa: error: document mixture '64k:1k-32k@x' is not TOTAL:LENGTH or TOTAL:MIN-MAX[@SEED], sizes in tokens "
        "or with k for 1024 (e.g. 64k:2k, 64k:1k-32k)\n")
    assert main(["bench", "attention", "--docs", "64k:1k-32k"]) == 2
    assert capsys.readouterr().err == "nsa: error: nsa bench attention needs a CUDA GPU\n"


def test_docs_alone_time_no_unpacked_lengths(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run", lambda **kwargs: seen.update(kwargs))
    main(["bench", "attention", "--docs", "64k:2k"])
    assert seen["docs"] == "64k:2k" and seen["lengths"] == []
    main(["bench", "attention", "--docs", "64k:2k", "--lengths", "8192"])
    assert seen["lengths"] == [8192]
    main(["bench", "attention"])
    assert seen["docs"] is None and seen["lengths"] == bench.LENGTHS
