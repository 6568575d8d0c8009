"""The fused Triton decode kernel against the PyTorch decode path (nsa.inference.attention):
outputs, chosen blocks and tokens read, for group sizes 1, 6 and 16, positions before the first
compressed block, on block edges and in the middle of blocks; then whole-model decoding with the
kernel (and the decode prep kernel before it, nsa.ops.triton.decode_prep) equals the full forward. Without a GPU this runs in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from nsa.inference import decode_attention, decode_step, new_cache, prefill
from nsa.model import ModelConfig, NSAParams, Transformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-5)


def model_for(n_heads, n_kv_heads, head_dim=8, backend="reference", **hyper):
    hp = dict(block_len=8, block_stride=4, sel_block=8, n_sel=4, window=12) | hyper
    cfg = ModelConfig(attention="nsa", vocab_size=53, dim=32, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, mlp_hidden=48,
                      nsa=NSAParams(**hp, phi_hidden=16, gate_hidden=16, backend=backend))
    torch.manual_seed(0)
    model = Transformer(cfg).eval().to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def random_layer_cache(model, positions, seed, capacity=80):
    """Layer 0's cache filled with random keys/values, with the compressed tokens each position has emitted."""
    cache = new_cache(model, len(positions), capacity)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(seed)
    for buf in (layer.k, layer.v, layer.k_cmp, layer.v_cmp):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    t = torch.tensor(positions, device=DEVICE)
    l, d = layer.geometry.block_len, layer.geometry.block_stride
    layer.n_cmp.copy_(((t + 1 - l).div(d, rounding_mode="floor") + 1).clamp_min(0))
    return layer, t


@pytest.mark.parametrize("heads,groups,head_dim", [(2, 2, 8), (6, 1, 8), (16, 1, 8), (12, 2, 8), (12, 2, 40)],
                         ids=["h1", "h6", "h16", "m7c-like", "m7c-like-d40"])
def test_triton_decode_kernel_matches_the_pytorch_path(heads, groups, head_dim):
    # head_dim 40: output columns in several tiles of the combine kernel, the last one partly masked.
    model = model_for(heads, groups, head_dim=head_dim)
    positions = [0, 6, 7, 31, 40, 63, 64, 79]  # before the first block, block edges, inside blocks, the end
    layer, t = random_layer_cache(model, positions, seed=heads)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(positions), heads, head_dim, generator=gen).to(DEVICE)
    gates = torch.rand(len(positions), heads, 3, generator=gen).to(DEVICE)
    want, want_reads = decode_attention(q, gates, layer, t, backend="reference")
    want_selected = layer.selected.clone()
    layer.selected.fill_(-7)
    got, got_reads = decode_attention(q, gates, layer, t, backend="triton")
    assert torch.equal(layer.selected, want_selected)
    assert torch.equal(got_reads, want_reads)
    torch.testing.assert_close(got, want, **TOL)
    # A decode step has both backends write the reads into the cache's counter itself (no copy after); one shape
    # suffices (the interpreter's kernel calls are the slow part of this file).
    for backend in ("reference", "triton") if (heads, head_dim) == (12, 8) else ():
        layer.reads.fill_(-1)
        _, reads = decode_attention(q, gates, layer, t, backend=backend, reads_out=layer.reads)
        assert reads.data_ptr() == layer.reads.data_ptr() and torch.equal(layer.reads, want_reads)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_triton_decode_with_a_long_window_and_blocks_across_chunks(seed):
    # 2-token selection blocks under 8-token compressed blocks: each compressed token feeds 4 selection
    # blocks, across the edges of the kernel's 16-block chunks (40 blocks: 3 chunks).
    model = model_for(4, 2, block_len=8, block_stride=2, sel_block=2, n_sel=8, window=100)
    layer, t = random_layer_cache(model, [3, 33, 50, 79], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q, gates = torch.randn(4, 4, 8, generator=gen).to(DEVICE), torch.rand(4, 4, 3, generator=gen).to(DEVICE)
    want, want_reads = decode_attention(q, gates, layer, t, backend="reference")
    want_selected = layer.selected.clone()
    got, got_reads = decode_attention(q, gates, layer, t, backend="triton")
    assert torch.equal(layer.selected, want_selected) and torch.equal(got_reads, want_reads)
    torch.testing.assert_close(got, want, **TOL)


@torch.no_grad()
@pytest.mark.parametrize("capacity,positions", [(600, [3, 100, 300, 520, 599]), (2100, [700, 1500, 2099])],
                         ids=["3-groups", "9-groups"])
@pytest.mark.parametrize("block_len,sel_block", [(8, 2), (4, 4)], ids=["overlaps", "two-weights"])
def test_triton_decode_ranks_many_chunk_groups_like_the_pytorch_path(capacity, positions, block_len, sel_block):
    # Selection blocks of 300 (or 1,050) per capacity unit: 19 chunks of 16, i.e. 3 groups of 8 chunks for the
    # parallel ranking, and 66 chunks, 9 groups: more than the 8 lists the merge takes at once. 8-token
    # compressed blocks over 2-token selection blocks give every token four overlaps; 4 over 4 is the case where
    # Eq. 9 is two weights per rank (M7C's), with a spill from each block into the next, across chunk edges too.
    _check_ranking(capacity, positions, block_len, sel_block)


@torch.no_grad()
def test_triton_decode_with_eight_chunks_a_program_matches_the_pytorch_path(monkeypatch):
    # At batch 16 a program of the compressed pass walks up to 8 chunks in a pipelined loop (1 on the GPU at these
    # sizes, 2 under the interpreter): 66 chunks make 9 programs a (sequence, group), the last with 2 chunks.
    import nsa.ops.triton.decode as kernels

    monkeypatch.setattr(kernels, "_chunks_per_program", lambda n_chunks, programs, device: 8)
    _check_ranking(2100, [700, 1500, 2099], block_len=4, sel_block=4)


def _check_ranking(capacity, positions, block_len, sel_block):
    capacity, positions = capacity * sel_block // 2, [p * sel_block // 2 for p in positions]
    model = model_for(6, 1, block_len=block_len, block_stride=2, sel_block=sel_block, n_sel=8, window=100)
    layer, t = random_layer_cache(model, positions, seed=11, capacity=capacity)
    gen = torch.Generator().manual_seed(12)
    n = len(positions)
    q, gates = torch.randn(n, 6, 8, generator=gen).to(DEVICE), torch.rand(n, 6, 3, generator=gen).to(DEVICE)
    want, want_reads = decode_attention(q, gates, layer, t, backend="reference")
    want_selected = layer.selected.clone()
    # Every query that reaches past the first group chooses unforced blocks in another: the ranking crosses
    # groups (and, at 1,050 blocks, the merge's tiles of 8 groups).
    j_t = t // sel_block
    far = j_t >= 256
    chosen = want_selected[far, 0]  # one key/value group
    assert far.any() and ((chosen >= 128) & (chosen < j_t[far, None] - 1)).any(-1).all()
    layer.selected.fill_(-7)
    got, got_reads = decode_attention(q, gates, layer, t, backend="triton")
    assert torch.equal(layer.selected, want_selected) and torch.equal(got_reads, want_reads)
    torch.testing.assert_close(got, want, **TOL)


@pytest.fixture
def triton_steps(monkeypatch):
    """Decode steps on the Triton backend (the decode prep kernel, then the decode attention) whatever the model's
    backend (its prefill stays on it); yields the list of the prep kernel's launches, to check that it ran."""
    import nsa.inference.decode as decode_module
    import nsa.ops.triton.decode_prep as prep_module

    launches = []
    prep = prep_module.decode_prep

    def counted_prep(*args, **kwargs):
        launches.append(args[0].shape)
        return prep(*args, **kwargs)

    monkeypatch.setattr(decode_module, "_step_backend", lambda attn: "triton")
    monkeypatch.setattr(prep_module, "decode_prep", counted_prep)
    return launches


def test_decoding_with_the_kernel_equals_the_full_forward(triton_steps):
    model = model_for(4, 2)
    tokens = torch.randint(0, 53, (2, 34), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    full = model(tokens)
    cache = new_cache(model, 2, 34)
    logits = [prefill(model, tokens[:, :22], cache)]
    for i in range(22, 34):  # crosses compressed emissions (every 4 tokens) and a selection-block edge (32)
        logits.append(decode_step(model, tokens[:, i], cache))
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 21:], **TOL)
    assert len(triton_steps) == 12 * 2  # every step of every layer prepared by the kernel


def test_the_graphed_decoder_steps_like_the_full_forward(triton_steps):
    """GraphedDecoder: on a GPU, CUDA graphs of the step with and without the compressed emission, picked per
    step from the host's lengths; without one, the same steps launched eagerly. Ragged prompts make the two
    sequences complete their blocks on different steps."""
    from nsa.inference.graphed import GraphedDecoder

    model = model_for(4, 2, backend="auto")  # the reference backend would keep the decoder off graphs
    tokens = torch.randint(0, 53, (2, 34), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    full = model(tokens)
    lengths = torch.tensor([13, 22], device=DEVICE)
    cache = new_cache(model, 2, 34)
    packed = torch.cat([tokens[0, :13], tokens[1, :22]])[None]  # the prompts back to back, one document each
    prefill(model, packed, cache, torch.tensor([0, 13, 35], dtype=torch.int32, device=DEVICE))
    decoder = GraphedDecoder(model, cache)
    for k in range(12):  # t = 13..24 and 22..33: emissions at t = 15, 19, 23 and 23, 27, 31 (l = 8, d = 4)
        got = decoder(tokens[[0, 1], lengths + k])
        torch.testing.assert_close(got, full[[0, 1], lengths + k], **TOL)
    assert cache.host_lengths == [25, 34] and cache.lengths.tolist() == [25, 34]
    assert set(decoder.graphs) == ({True, False} if DEVICE == "cuda" else set())
    nc = cache.layers[0].n_cmp.tolist()
    assert nc == [(25 - 8) // 4 + 1, (34 - 8) // 4 + 1]  # every due block emitted once, none twice
    assert triton_steps  # the steps (or, on a GPU, the captured graphs) ran the decode prep kernel


def dense_layer_cache(n_heads, n_kv_heads, positions, capacity, seed):
    """Layer 0's cache of a dense model filled with random keys and values, and tokens past each position set to
    a large finite value: a kernel that reads past t is off by far more than the tolerance."""
    cfg = ModelConfig(attention="dense", vocab_size=53, dim=32, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=8, mlp_hidden=48)
    model = Transformer(cfg).eval().to(DEVICE)
    cache = new_cache(model, len(positions), capacity)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(seed)
    t = torch.tensor(positions, device=DEVICE)
    past = (torch.arange(capacity, device=DEVICE)[None, :] > t[:, None])[:, :, None, None]
    for buf in (layer.k, layer.v):
        buf.copy_(torch.where(past, 1e4, torch.randn(buf.shape, generator=gen).to(DEVICE)))
    return layer, t


@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (6, 1), (16, 1)])
def test_dense_split_decode_kernel_matches_sdpa_for_unequal_positions(n_heads, n_kv_heads, monkeypatch):
    # nsa.ops.triton.dense_decode with splits of 64 tokens over a 200-token cache: positions before, on and after
    # split edges, in the last (partial) split, one per sequence of a batch; group sizes 1, 6 and 16.
    from nsa.inference import dense_decode_attention
    from nsa.ops.tuning import TUNING

    monkeypatch.setattr(TUNING, "dense_decode_split", 64)
    layer, t = dense_layer_cache(n_heads, n_kv_heads, [0, 63, 64, 130, 199], capacity=200, seed=n_heads)
    q = torch.randn(len(t), n_heads, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    o, reads = dense_decode_attention(q, layer, t, backend="triton")
    want, want_reads = dense_decode_attention(q, layer, t, backend="reference")
    torch.testing.assert_close(o, want, **TOL)
    assert torch.equal(reads, want_reads) and reads[:, 0].tolist() == [1, 64, 65, 131, 200]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_dense_split_decode_kernel_at_a_real_shape_in_bf16():
    # M7C's heads (12 query, 2 key/value of 64) over a 64k cache in bf16, at a split edge, mid-cache and the last
    # token, against SDPA in float32 on the same cache.
    from nsa.ops.triton.dense_decode import dense_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, L, G, H, D = 3, 65536, 2, 12, 64
    k, v = (torch.randn(B, L, G, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    t = torch.tensor([511, 30000, L - 1], device="cuda")
    o = dense_decode_triton(q, k, v, t, D**-0.5)
    valid = torch.arange(L, device="cuda") <= t[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=valid[:, None, None],
        enable_gqa=True)[:, :, 0]
    assert ((o.float() - want).norm() / want.norm()).item() < 1e-2
