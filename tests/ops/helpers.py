"""Shared test helpers: random NSA inputs at given shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextlib.contextmanager
def tf32_matmuls(allowed: bool) -> Iterator[None]:
    """Inside, PyTorch allows TF32 in float32 CUDA matmuls or not; afterwards its settings are as they were:
    torch.backends.cuda.matmul.fp32_precision and the global torch.backends.fp32_precision, which sets it too
    (restored first), or before PyTorch 2.9 allow_tf32. Once fp32_precision has been set, reading allow_tf32
    raises, so it is not read where fp32_precision exists."""
    matmul = torch.backends.cuda.matmul
    if getattr(matmul, "fp32_precision", None) is None:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = allowed
        try:
            yield
        finally:
            matmul.allow_tf32 = saved
        return
    saved = torch.backends.fp32_precision, matmul.fp32_precision
    matmul.fp32_precision = "tf32" if allowed else "ieee"
    try:
        yield
    finally:
        torch.backends.fp32_precision, matmul.fp32_precision = saved


class DispatchedOps(TorchDispatchMode):
    """Records the qualified name of every operator dispatched inside (e.g. "nsa::forward", "aten::mm")."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


class LaunchSpy:
    """Stands in for a @triton.jit kernel: records each launch's grid and keyword arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def packed_branch_kernels(mode, geometry, scale, q, k, v, indices, do, layout):
    """One span branch of a packed stream on the kernels' stages (span_forward, span_dkdv, query_grad): its output
    and (dq, dk, dv) for the output gradient do. indices: MODE_SEL's document-relative choices (tiled path)."""
    from nsa.ops.branches import MODE_CMP, MODE_SEL, MODE_WIN, SEL_NONE, SEL_TILED, SelectedDQ
    from nsa.ops.dispatch import query_grad, span_dkdv, span_forward
    from nsa.ops.triton.span_attention import chosen_bits

    bits = chosen_bits(indices, 64) if mode == MODE_SEL else None
    o, lse = span_forward(q, k, v, mode, scale, geometry, bits, layout=layout)
    delta = (do.float() * o.float()).sum(-1)
    dk, dv = span_dkdv(q, k, v, do, lse, delta, mode, scale, geometry, bits, layout)
    slot = {MODE_CMP: 0, MODE_SEL: 1, MODE_WIN: 2}[mode]
    lse_g, delta_g = (torch.stack([x if i == slot else torch.zeros_like(x) for i in range(3)]) for x in (lse, delta))
    sel = SelectedDQ(SEL_TILED, k=k, v=v, choice=bits) if mode == MODE_SEL else SelectedDQ(SEL_NONE)
    dq = query_grad(q, do, lse_g, delta_g, scale, geometry, (k, v) if mode == MODE_CMP else None,
                    (k, v) if mode == MODE_WIN else None, sel, layout)
    return o, (dq, dk.to(k.dtype), dv.to(v.dtype))


def packed_branch_reference(mode, geometry, scale, q, k, v, indices, do, cu_seqlens):
    """The same branch with each document run alone on the reference (k: the documents' compressed rows back to
    back for MODE_CMP, their tokens otherwise); rows of k that no document holds get a zero gradient."""
    from nsa.ops import compressed_offsets, reference
    from nsa.ops.branches import MODE_CMP, MODE_WIN

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    bounds, offsets = cu_seqlens.tolist(), compressed_offsets(cu_seqlens, geometry).tolist()
    outs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b == a:
            continue
        ka, kb = (offsets[i], offsets[i + 1]) if mode == MODE_CMP else (a, b)
        qd, kd, vd = q[:, a:b], k[:, ka:kb], v[:, ka:kb]
        if mode == MODE_CMP:
            outs.append(reference.compressed_attention(qd, kd, vd, block_len=geometry.block_len,
                                                       block_stride=geometry.block_stride, scale=scale))
        elif mode == MODE_WIN:
            outs.append(reference.window_attention(qd, kd, vd, window=geometry.window, scale=scale))
        else:
            outs.append(reference.selected_attention(qd, kd, vd, indices[:, a:b], sel_block=geometry.sel_block,
                                                     scale=scale))
    out = torch.cat(outs, dim=1)
    return out.detach(), torch.autograd.grad((out * do).sum(), (q, k, v))
