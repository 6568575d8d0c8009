"""The selection split in two kernels (TUNING.selection_split: block scores, then top-n by argmax passes) against
the streaming kernel, bit for bit, and the reference, unpacked and on packed documents.

Without a GPU these run in Triton's CPU interpreter (tests/conftest.py): tiny shapes, few programs, float32.
"""

import pytest
import torch

from helpers import LaunchSpy, assert_same_selection
from nsa.ops import NSAGeometry, compressed_offsets, reference, select_blocks, tuning
from nsa.ops.branches import MODE_CMP
from nsa.ops.dispatch import select_blocks as dispatch_select_blocks
from nsa.ops.dispatch import span_forward
from nsa.ops.packing import packed_layout
from nsa.ops.triton import selection_split
from nsa.ops.triton.selection import select_blocks_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-5 if DEVICE == "cpu" else 1e-2


@pytest.fixture
def split(monkeypatch):
    """selection_split on, and a LaunchSpy on the top-n kernel (so a test knows the split path ran)."""
    monkeypatch.setattr(tuning.TUNING, "selection_split", True)
    spy = LaunchSpy(selection_split._top_kernel)
    monkeypatch.setattr(selection_split, "_top_kernel", spy)
    return spy


def inputs(T, H, G, geometry, seed, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g)
    k_cmp = torch.randn(1, geometry.num_compressed_blocks(T), G, D, generator=g)
    return q.to(DEVICE), k_cmp.to(DEVICE)


def split_and_streaming(q, k_cmp, geometry, scale, layout=None):
    """(the dispatcher's indices, the streaming kernel's) on one compressed-kernel lse, as nsa.ops.select_blocks
    runs them."""
    _, lse = span_forward(q, k_cmp, k_cmp, MODE_CMP, scale, geometry, layout=layout)
    return (dispatch_select_blocks(q, k_cmp, lse, scale, geometry, layout),
            select_blocks_fwd(q, k_cmp, lse, scale, geometry, layout))


# (T, H, G, l, d, l', n): odd lengths and one shorter than a selection block; groups of 1, 6 and 16 heads; the
# two-weight stencil (l <= l', l'/d a power of two) across chunks, general overlaps (l > l', l'/d = 3), n > 16.
CASES = [
    (3, 6, 1, 8, 4, 4, 3),
    (45, 2, 2, 8, 4, 4, 3),
    (101, 6, 1, 8, 4, 16, 5),
    (77, 16, 1, 8, 4, 4, 5),
    (61, 3, 3, 6, 3, 9, 4),
    (50, 4, 2, 4, 2, 2, 20),
]


@pytest.mark.parametrize("T,H,G,l,d,lp,n", CASES, ids=[f"T{c[0]}-h{c[1] // c[2]}-lp{c[5]}" for c in CASES])
def test_split_selection_equals_the_streaming_kernel_and_the_reference(T, H, G, l, d, lp, n, split):
    geometry = NSAGeometry(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=1)
    q, k_cmp = inputs(T, H, G, geometry, seed=T)
    idx, want = split_and_streaming(q, k_cmp, geometry, 0.4)
    assert split.launches, "the split kernels did not run"
    assert idx.shape == (1, T, G, n) and idx.dtype == torch.int64
    assert torch.equal(idx, want)
    ref = reference.select_blocks(q.cpu(), k_cmp.cpu(), geometry=geometry, scale=0.4)
    scores = reference.selection_scores(q.cpu(), k_cmp.cpu(), block_len=l, block_stride=d, sel_block=lp, scale=0.4)
    assert_same_selection(idx.cpu(), ref, scores, rtol=RTOL)


@pytest.mark.parametrize("equal", ["queries", "keys"])
def test_split_selection_ties_go_to_the_lower_block(equal, split):
    # Zero queries or identical compressed keys: every visible compressed token gets the same probability, so
    # block scores tie exactly and the lower block must win, as in the reference.
    geometry = NSAGeometry(block_len=4, block_stride=4, sel_block=4, n_sel=5, window=1)
    q, k_cmp = inputs(53, 6, 1, geometry, seed=3)
    if equal == "queries":
        q = torch.zeros_like(q)
    else:
        k_cmp = k_cmp[:, :1].expand_as(k_cmp).contiguous()
    idx = select_blocks(q, k_cmp, geometry=geometry, backend="triton")
    assert split.launches
    assert torch.equal(idx.cpu(), reference.select_blocks(q.cpu(), k_cmp.cpu(), geometry=geometry))


# 1 token, shorter than a compression block, shorter than a selection block, not a multiple of any block size,
# several documents in one tile of queries, empty documents in the middle and at the end, one long enough for two
# chunks of 16 selection blocks.
LENGTHS = [1, 3, 0, 13, 90, 8, 21, 5, 0]
PACKED_CASES = [(4, 2, 4, 3, 6, 1), (8, 4, 4, 3, 16, 1), (4, 2, 8, 4, 2, 2)]


@pytest.mark.parametrize("l,d,lp,n,H,G", PACKED_CASES, ids=["stencil-h6", "overlap-h16", "h1"])
def test_packed_split_selection_equals_the_streaming_kernel_and_each_document_alone(l, d, lp, n, H, G, split):
    geometry = NSAGeometry(block_len=l, block_stride=d, sel_block=lp, n_sel=n, window=1)
    q, k_cmp = inputs(sum(LENGTHS), H, G, geometry, seed=H)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = 8**-0.5
    idx, want = split_and_streaming(q, k_cmp, geometry, scale, packed_layout(cu, geometry, q.shape[1],
                                                                             k_cmp.shape[1]))
    assert split.launches and all(kw["PACKED"] for _, kw in split.launches)
    assert torch.equal(idx, want)
    idx, q, k_cmp = idx.cpu(), q.cpu(), k_cmp.cpu()
    bounds, offsets = cu.tolist(), compressed_offsets(cu.cpu(), geometry).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            scores = reference.selection_scores(q[:, a:b], k_cmp[:, offsets[i]:offsets[i + 1]], block_len=l,
                                                block_stride=d, sel_block=lp, scale=scale)
            want = reference.top_n_blocks(scores, sel_block=lp, n_sel=n)
            assert_same_selection(idx[:, a:b], want, scores, rtol=RTOL)


def test_the_switch_and_the_block_limit_choose_the_kernels(split, monkeypatch):
    geometry = NSAGeometry(block_len=8, block_stride=4, sel_block=4, n_sel=3, window=1)
    q, k_cmp = inputs(40, 2, 1, geometry, seed=0)
    monkeypatch.setattr(tuning.TUNING, "selection_split", False)
    off = select_blocks(q, k_cmp, geometry=geometry, backend="triton")
    assert not split.launches
    monkeypatch.setattr(tuning.TUNING, "selection_split", True)
    monkeypatch.setattr(selection_split, "MAX_BLOCKS", 9)  # 40 tokens make 10 blocks: the streaming kernel
    assert torch.equal(select_blocks(q, k_cmp, geometry=geometry, backend="triton"), off)
    assert not split.launches
    monkeypatch.setattr(selection_split, "MAX_BLOCKS", 10)
    assert torch.equal(select_blocks(q, k_cmp, geometry=geometry, backend="triton"), off)
    assert len(split.launches) == 1
