"""Shared test helpers: random NSA inputs at given shapes."""

from __future__ import annotations

import torch

from nsa.ops.geometry import num_compressed_blocks

NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def nsa_inputs(B, T, H, G, Dk, Dv, *, block_len, block_stride, dtype=torch.float32, seed=0, requires_grad=False):
    """Random q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates (gates in (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    nc = num_compressed_blocks(T, block_len, block_stride)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    tensors = [
        rnd(B, T, H, Dk),
        rnd(B, nc, G, Dk),
        rnd(B, nc, G, Dv),
        rnd(B, T, G, Dk),
        rnd(B, T, G, Dv),
        rnd(B, T, G, Dk),
        rnd(B, T, G, Dv),
        torch.rand(B, T, H, 3, generator=g, dtype=torch.float64).to(dtype),
    ]
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
    return tensors


def naive_masked_attention(q, k, v, allowed, scale):
    """softmax(q k^T * scale) v over allowed [T,S] keys, written out directly; q [B,T,H,D], k/v [B,S,G,D]."""
    h = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(h, dim=2)
    v = v.repeat_interleave(h, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(logits, -1), v)


def assert_same_selection(idx, ref_idx, scores, rtol=1e-5):
    """Selections agree, except where the blocks swapped have reference scores within rtol of each other."""
    diff = (idx != ref_idx).any(-1)
    for b, t, g in diff.nonzero().tolist():
        got = set(idx[b, t, g].tolist()) - {-1}
        want = set(ref_idx[b, t, g].tolist()) - {-1}
        assert len(got) == len(want), (b, t, g, got, want)
        s = scores[b, t, g].double()
        only_got = s[sorted(got - want)]
        only_want = s[sorted(want - got)]
        gap = (only_got.min() - only_want.max()).abs().item() if len(only_got) else 0.0
        assert gap <= rtol * s.max().item() + 1e-12, (b, t, g, sorted(got), sorted(want), gap)


class LaunchSpy:
    """Stands in for a @triton.jit kernel: records each launch's grid and keyword arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch
