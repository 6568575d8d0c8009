"""NSA on Triton: the branch kernels composed into PyTorch custom ops with autograd.

`nsa::forward` and `nsa::backward` are opaque to torch.compile (registered with fake
implementations), so a compiled model neither breaks its graph on them nor traces
into them. Inputs are cast to q's dtype (what autocast produced for q); all kernels
accumulate in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..geometry import NSAGeometry
from .common import unfilled
from .gating import gate_grads
from .hopper_selected_forward import hopper_selected_forward_eligible
from .query_grad import query_grad
from .range_attention import MODE_CMP, MODE_WIN, range_attention_dkdv, range_attention_fwd
from .inverse_index import num_items
from .selected_attention import (BLOCKS, build_inverse_index, inverse_layout, selected_backward, selected_forward,
                                 selected_path)
from .selection import select_blocks_fwd
from .streams import Beside
from .tuning import TUNING

_F32 = torch.float32


def _num_items(B: int, T: int, G: int, n: int, sel_block: int, device: torch.device) -> int:
    """Length of the inverse index's work-item arrays (inverse_index's host-side bound)."""
    return num_items(B, T, G, n, -(-T // sel_block), *inverse_layout(T, device))


def _inverse_readers(q: Tensor, k: Tensor, v: Tensor, sel_block: int, needs_grad: bool) -> tuple[bool, bool]:
    """Whether the selected forward reads the inverse index (block-centric), and whether the forward builds it at
    all: also for a block-centric backward, which a tiled forward may precede (selected_path). From metadata
    alone: the fake implementation decides it too."""
    T, h = q.shape[1], q.shape[2] // k.shape[2]
    forward = selected_path(T, h, sel_block, True, hopper_selected_forward_eligible(q, k, v, sel_block)) == BLOCKS
    return forward, forward or (needs_grad and selected_path(T, h, sel_block) == BLOCKS)


def _no_inverse(q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    empty = q.new_empty(0, dtype=torch.int32)
    return empty, empty.clone(), empty.clone(), empty.clone()


def _compressed_and_choice(q, k_cmp, v_cmp, block_len, block_stride, sel_block, n_sel, window, scale):
    """The compressed branch's output and lse, and the chosen blocks."""
    o_cmp, lse_cmp = range_attention_fwd(q, k_cmp, v_cmp, MODE_CMP, scale, block_len, block_stride, window)
    indices = select_blocks_fwd(q, k_cmp, lse_cmp, scale, block_len, block_stride, sel_block, n_sel)
    return o_cmp, lse_cmp, indices


@torch.library.custom_op("nsa::forward", mutates_args=())
def nsa_forward(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, block_len: int, block_stride: int, sel_block: int, n_sel: int, window: int, scale: float,
    needs_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """o, then what backward needs: each branch's output and lse, the indices and their inverse index (built where
    a block-centric selected branch reads it: this forward, or with `needs_grad` the backward)."""
    forward_reads, blocks = _inverse_readers(q, k_sel, v_sel, sel_block, needs_grad)
    T = q.shape[1]
    with unfilled():
        # The compressed branch and the choice it feeds run beside the window branch (streams.py).
        beside = Beside(q)
        o_cmp, lse_cmp, indices = beside.run(_compressed_and_choice, q, k_cmp, v_cmp, block_len, block_stride,
                                             sel_block, n_sel, window, scale)
        inverse = beside.run(build_inverse_index, indices, T, sel_block) if forward_reads else _no_inverse(q)
        o_win, lse_win = range_attention_fwd(q, k_win, v_win, MODE_WIN, scale, block_len, block_stride, window)
        beside.join()
        forward_inverse = inverse
        if blocks and not forward_reads:
            # Only the backward reads it: built beside the selected forward, off the forward's critical path
            # (at M7C 4k x 1 its ~0.1 ms of small kernels take as long as that forward).
            inverse = beside.run(build_inverse_index, indices, T, sel_block)
        o, o_sel, lse_sel = selected_forward(q, k_sel, v_sel, indices, forward_inverse, o_cmp, o_win, gates, scale,
                                             sel_block)
        beside.join()
    return o, o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win, indices, *inverse


@nsa_forward.register_fake
def _(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_len, block_stride, sel_block, n_sel, window, scale,
      needs_grad):
    B, T, H, _ = q.shape
    G, Dv = k_sel.shape[2], v_sel.shape[-1]
    o = q.new_empty(B, T, H, Dv)
    lse = q.new_empty(B, T, H, dtype=_F32)
    idx = q.new_empty(B, T, G, n_sel, dtype=torch.int64)
    blocks = _inverse_readers(q, k_sel, v_sel, sel_block, needs_grad)[1]
    item = q.new_empty(_num_items(B, T, G, n_sel, sel_block, q.device) if blocks else 0, dtype=torch.int32)
    entries = q.new_empty(B * G * T * n_sel if blocks else 0, dtype=torch.int32)
    return (o, torch.empty_like(o), lse, torch.empty_like(o), torch.empty_like(lse), torch.empty_like(o),
            torch.empty_like(lse), idx, item, torch.empty_like(item), torch.empty_like(item), entries)


@torch.library.custom_op("nsa::backward", mutates_args=())
def nsa_backward(
    do: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
    gates: Tensor, o_cmp: Tensor, lse_cmp: Tensor, o_sel: Tensor, lse_sel: Tensor, o_win: Tensor, lse_win: Tensor,
    indices: Tensor, item_key: Tensor, item_start: Tensor, item_count: Tensor, entries: Tensor,
    block_len: int, block_stride: int, sel_block: int, window: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)."""
    do = do.contiguous()
    with unfilled():
        # Each branch's gate comes folded into its lse and delta (see gating.py).
        dgates, delta, lse_g = gate_grads(do, o_cmp, o_sel, o_win, gates, lse_cmp, lse_sel, lse_win)
        inverse = (item_key, item_start, item_count, entries)
        # The compressed (and optionally the window) branch's dK/dV run beside the selected branch and dQ.
        beside = Beside(q)
        dk_cmp, dv_cmp = beside.run(_dkdv_in_type, q, k_cmp, v_cmp, do, lse_g[0], delta[0], MODE_CMP, scale,
                                    block_len, block_stride, window)
        window_beside = beside.run if TUNING.window_grads_beside else _call
        dk_win, dv_win = window_beside(_dkdv_in_type, q, k_win, v_win, do, lse_g[2], delta[2], MODE_WIN, scale,
                                       block_len, block_stride, window)
        dk_sel, dv_sel, sel_dq = selected_backward(q, k_sel, v_sel, indices, inverse, do, lse_g[1], delta[1],
                                                   scale, sel_block)
        if dk_sel.dtype != k_sel.dtype:
            # Float32 sums (row splits, atomics) are converted beside dQ rather than after it, when nothing else runs.
            beside.follow(dk_sel, dv_sel)
            dk_sel, dv_sel = beside.run(_in_type, (dk_sel, dv_sel), (k_sel, v_sel))
        dq = query_grad(q, do, lse_g, delta, scale, block_len, block_stride, window, (k_cmp, v_cmp),
                        (k_win, v_win), sel_dq)
        beside.join()
    return dq.to(q.dtype), dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates


@nsa_backward.register_fake
def _(do, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *rest):
    return tuple(torch.empty_like(x) for x in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _in_type(grads: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(g.to(x.dtype) for g, x in zip(grads, inputs))


def _dkdv_in_type(q: Tensor, k: Tensor, v: Tensor, *args) -> tuple[Tensor, ...]:
    """range_attention_dkdv's (dK, dV) in the keys' and values' types."""
    return _in_type(range_attention_dkdv(q, k, v, *args), (k, v))


def _setup_context(ctx, inputs, output):
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_len, block_stride, sel_block, _, window, scale, _ = inputs
    ctx.save_for_backward(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *output[1:])
    ctx.hyper = (block_len, block_stride, sel_block, window, scale)
    # Only o takes a gradient; the rest are what the backward reads. Unmarked, autograd would fill a zero gradient
    # for each of the eleven before every backward (M7C 4k x 1: ~20 us of its ~450).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, do, *_unused):
    grads = nsa_backward(do, *ctx.saved_tensors, *ctx.hyper)
    return (*grads, None, None, None, None, None, None, None)


nsa_forward.register_autograd(_backward, setup_context=_setup_context)


def _last_dim_contiguous(t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def nsa_attention_triton(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, geometry: NSAGeometry,
                         scale: float) -> Tensor:
    dtype = q.dtype
    args = [_last_dim_contiguous(t, dtype) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)]
    # A forward with no backward to follow (inference, evaluation) skips what only the backward reads.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in args)
    return nsa_forward(*args, *geometry.as_tuple(), float(scale), needs_grad)[0]


@torch.no_grad()
def select_blocks_triton(q, k_cmp, geometry: NSAGeometry, scale: float) -> Tensor:
    block_len, block_stride, sel_block, n_sel, _ = geometry.as_tuple()
    q = _last_dim_contiguous(q, q.dtype)
    k_cmp = _last_dim_contiguous(k_cmp, q.dtype)
    # The compressed branch's log-sum-exp normalises p_cmp; its values output is not needed here.
    _, lse = range_attention_fwd(q, k_cmp, k_cmp, MODE_CMP, float(scale), block_len, block_stride, 1)
    return select_blocks_fwd(q, k_cmp, lse, float(scale), block_len, block_stride, sel_block, n_sel)

