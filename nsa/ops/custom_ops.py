"""NSA on the GPU kernels: the stages in their order, on their streams, as the PyTorch custom ops `nsa::forward` and
`nsa::backward` with autograd, and for eager calls the same stages as an autograd.Function (EagerAttention).

Packed documents: both ops take an optional cu_seqlens (int32 [N+1]); the forward builds the documents' tables
(nsa.ops.packing) once and hands them to every stage, the backward rebuilds them (a few small device ops) rather
than saving eight more tensors.

Both ops are opaque to torch.compile (registered with fake implementations), so a compiled model neither breaks its
graph on them nor traces into them; they never sync with the host, so a step can be captured in a CUDA graph. Which
kernel serves each stage is nsa.ops.dispatch's choice. Inputs are cast to q's dtype (what autocast produced for q);
all kernels accumulate in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .branches import MODE_CMP, MODE_WIN
from .geometry import NSAGeometry
from .packing import PackedLayout, packed_layout, selection_block_capacity
from .triton.common import eager_call, skip_deterministic_fill
from .triton.gating import gate_grads
from .triton.inverse_index import build_inverse_index, built_items

_F32 = torch.float32


def _no_inverse(q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    empty = q.new_empty(0, dtype=torch.int32)
    return empty, empty.clone(), empty.clone(), empty.clone()


def _layout(cu_seqlens: Tensor | None, geometry: NSAGeometry, q: Tensor, k_cmp: Tensor) -> PackedLayout | None:
    """The packed documents' tables, or None for the unpacked path."""
    return None if cu_seqlens is None else packed_layout(cu_seqlens, geometry, q.shape[1], k_cmp.shape[1])


def _compressed_and_choice(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, geometry: NSAGeometry, scale: float,
                           layout: PackedLayout | None):
    """The compressed branch's output and lse, and the chosen blocks."""
    o_cmp, lse_cmp = dispatch.span_forward(q, k_cmp, v_cmp, MODE_CMP, scale, geometry, layout=layout)
    return o_cmp, lse_cmp, dispatch.select_blocks(q, k_cmp, lse_cmp, scale, geometry, layout)


def _forward_stages(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int, scale: float,
    needs_grad: bool, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """nsa::forward's outputs (below), from its stages."""
    geometry = NSAGeometry(block_len, block_stride, sel_block, n_sel, window)
    forward_reads, built = dispatch.inverse_index_readers(q, k_sel, sel_block, needs_grad)
    T = q.shape[1]
    with skip_deterministic_fill():
        layout = _layout(cu_seqlens, geometry, q, k_cmp)
        # The compressed branch and the choice it feeds run beside the window branch.
        side = dispatch.side_stream(q)
        o_cmp, lse_cmp, indices = side.run(_compressed_and_choice, q, k_cmp, v_cmp, geometry, scale, layout)
        inverse = side.run(build_inverse_index, indices, T, sel_block, layout) if forward_reads else _no_inverse(q)
        o_win, lse_win = dispatch.span_forward(q, k_win, v_win, MODE_WIN, scale, geometry, layout=layout)
        side.join()
        forward_inverse = inverse
        if built and not forward_reads:
            # Only the backward reads it: built beside the selected forward, off the forward's critical path.
            inverse = side.run(build_inverse_index, indices, T, sel_block, layout)
        o, o_sel, lse_sel = dispatch.selected_forward(q, k_sel, v_sel, indices, forward_inverse, o_cmp, o_win, gates,
                                                      scale, geometry, layout)
        side.join()
    return o, o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win, indices, *inverse


@torch.library.custom_op("nsa::forward", mutates_args=())
def nsa_forward(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int, scale: float,
    needs_grad: bool, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """o, then what backward needs: each branch's output and lse, the indices and their inverse index (built where
    a block-centric selected branch reads it: this forward, or with `needs_grad` the backward). With cu_seqlens,
    one packed stream (B = 1) of documents."""
    return _forward_stages(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_len, block_stride, sel_block,
                           n_sel, window, scale, needs_grad, cu_seqlens)


@nsa_forward.register_fake
def _(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_len, block_stride, sel_block, n_sel, window, scale,
      needs_grad, cu_seqlens=None):
    B, T, H, _ = q.shape
    G, Dv = k_sel.shape[2], v_sel.shape[-1]
    o = q.new_empty(B, T, H, Dv)
    lse = q.new_empty(B, T, H, dtype=_F32)
    idx = q.new_empty(B, T, G, n_sel, dtype=torch.int64)
    built = dispatch.inverse_index_readers(q, k_sel, sel_block, needs_grad)[1]
    # Packed, the index is keyed by the stream's selection blocks (the layout's static capacity).
    blocks = None if cu_seqlens is None else selection_block_capacity(T, cu_seqlens.shape[0], sel_block)
    item = q.new_empty(built_items(B, T, G, n_sel, sel_block, q.device, blocks) if built else 0, dtype=torch.int32)
    entries = q.new_empty(B * G * T * n_sel if built else 0, dtype=torch.int32)
    return (o, torch.empty_like(o), lse, torch.empty_like(o), torch.empty_like(lse), torch.empty_like(o),
            torch.empty_like(lse), idx, item, torch.empty_like(item), torch.empty_like(item), entries)


def _backward_stages(
    do: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, o_cmp: Tensor, lse_cmp: Tensor, o_sel: Tensor, lse_sel: Tensor, o_win: Tensor, lse_win: Tensor,
    indices: Tensor, item_key: Tensor, item_start: Tensor, item_count: Tensor, entries: Tensor,
    block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int, scale: float,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """nsa::backward's gradients (below), from its stages."""
    geometry = NSAGeometry(block_len, block_stride, sel_block, n_sel, window)
    do = do.contiguous()
    with skip_deterministic_fill():
        layout = _layout(cu_seqlens, geometry, q, k_cmp)
        # Each branch's gate comes folded into its lse and delta (see gating.py).
        dgates, delta, lse_g = gate_grads(do, o_cmp, o_sel, o_win, gates, lse_cmp, lse_sel, lse_win)
        inverse = (item_key, item_start, item_count, entries)
        # The compressed and window branches' dK/dV run beside the selected branch and dQ.
        side = dispatch.side_stream(q)
        dk_cmp, dv_cmp = side.run(_dkdv_in_type, q, k_cmp, v_cmp, do, lse_g[0], delta[0], MODE_CMP, scale, geometry,
                                  None, layout)
        dk_win, dv_win = side.run(_dkdv_in_type, q, k_win, v_win, do, lse_g[2], delta[2], MODE_WIN, scale, geometry,
                                  None, layout)
        dk_sel, dv_sel, sel_dq = dispatch.selected_backward(q, k_sel, v_sel, indices, inverse, do, lse_g[1], delta[1],
                                                            scale, geometry, layout)
        if dk_sel.dtype != k_sel.dtype:
            # Float32 sums (row splits, atomics) are converted beside dQ rather than after it, when nothing else runs.
            side.follow(dk_sel, dv_sel)
            dk_sel, dv_sel = side.run(_in_type, (dk_sel, dv_sel), (k_sel, v_sel))
        dq = dispatch.query_grad(q, do, lse_g, delta, scale, geometry, (k_cmp, v_cmp), (k_win, v_win), sel_dq, layout)
        side.join()
    return dq.to(q.dtype), dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates


@torch.library.custom_op("nsa::backward", mutates_args=())
def nsa_backward(
    do: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, o_cmp: Tensor, lse_cmp: Tensor, o_sel: Tensor, lse_sel: Tensor, o_win: Tensor, lse_win: Tensor,
    indices: Tensor, item_key: Tensor, item_start: Tensor, item_count: Tensor, entries: Tensor,
    block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int, scale: float,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates); with cu_seqlens, of a packed stream."""
    return _backward_stages(do, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, o_cmp, lse_cmp, o_sel, lse_sel,
                            o_win, lse_win, indices, item_key, item_start, item_count, entries, block_len,
                            block_stride, sel_block, n_sel, window, scale, cu_seqlens)


@nsa_backward.register_fake
def _(do, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *rest):
    return tuple(torch.empty_like(x) for x in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))


def _in_type(grads: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(g.to(x.dtype) for g, x in zip(grads, inputs))


def _dkdv_in_type(q: Tensor, k: Tensor, v: Tensor, *args) -> tuple[Tensor, ...]:
    """dispatch.span_dkdv's (dK, dV) in the keys' and values' types."""
    return _in_type(dispatch.span_dkdv(q, k, v, *args), (k, v))


def _setup_context(ctx, inputs, output):
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *geometry, scale, _, cu_seqlens = inputs
    ctx.save_for_backward(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *output[1:], cu_seqlens)
    ctx.geometry_and_scale = (*geometry, scale)
    # Only o takes a gradient; the rest are what the backward reads. Unmarked, autograd would fill a zero gradient
    # for each of the eleven before every backward.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _input_grads(ctx, do: Tensor, backward) -> tuple:
    """The gradients of the forward's inputs from `backward` (nsa::backward or its stages) on the saved tensors."""
    *saved, cu_seqlens = ctx.saved_tensors
    grads = backward(do, *saved, *ctx.geometry_and_scale, cu_seqlens)
    return (*grads, None, None, None, None, None, None, None, None)


def _backward(ctx, do, *_unused):
    return _input_grads(ctx, do, nsa_backward)


nsa_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The stages of nsa::forward and nsa::backward called without the custom ops, for eager calls: the same
    kernels and saved tensors, without the dispatcher's host time per call (a custom op's Python dispatch costs
    several times an autograd.Function's), which paces short eager calls. torch.compile, export and fake tensors
    take the custom ops, which they can trace."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_stages(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, *_unused):
        return _input_grads(ctx, do, _backward_stages)



def _last_dim_contiguous(t: Tensor, dtype: torch.dtype) -> Tensor:
    if t.dtype != dtype:  # checked here: a no-op .to() still costs a dispatch on every eager call
        t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def nsa_attention_kernels(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
                          v_win: Tensor, gates: Tensor, geometry: NSAGeometry, scale: float,
                          cu_seqlens: Tensor | None = None) -> Tensor:
    """nsa.ops.nsa_attention on the kernels (arguments checked by the caller); cu_seqlens: packed documents."""
    dtype = q.dtype
    args = [_last_dim_contiguous(t, dtype) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)]
    # A forward with no backward to follow (inference, evaluation) skips what only the backward reads.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in args)
    op = EagerAttention.apply if eager_call(args) else nsa_forward
    return op(*args, *geometry.as_tuple(), float(scale), needs_grad, cu_seqlens)[0]


@torch.no_grad()
def select_blocks_kernels(q: Tensor, k_cmp: Tensor, geometry: NSAGeometry, scale: float,
                          cu_seqlens: Tensor | None = None) -> Tensor:
    """nsa.ops.select_blocks on the kernels (arguments checked by the caller); cu_seqlens: packed documents."""
    q = _last_dim_contiguous(q, q.dtype)
    k_cmp = _last_dim_contiguous(k_cmp, q.dtype)
    layout = _layout(cu_seqlens, geometry, q, k_cmp)
    # The compressed branch's log-sum-exp normalises p_cmp; its values output is not needed here.
    _, lse = dispatch.span_forward(q, k_cmp, k_cmp, MODE_CMP, float(scale), geometry, layout=layout)
    return dispatch.select_blocks(q, k_cmp, lse, float(scale), geometry, layout)
