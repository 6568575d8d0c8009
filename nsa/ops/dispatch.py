"""Which kernel serves each stage of NSA on CUDA, and the buffers the stages hand each other.

Every choice between kernels is made here, from the tensors' metadata and `TUNING`:

- span_forward, span_dkdv (compressed, window and tiled selected branches) and query_grad (dQ of every branch):
  the Gluon kernel of nsa.ops.gluon where its switch is on, the call is large enough (TUNING.gluon_span_min_elements)
  and the kernel supports it (an sm_90 GPU, bf16, ...; packed documents, a PackedLayout, only with
  TUNING.gluon_packed, and never the tiled selected branch), the Triton kernel of nsa.ops.triton otherwise;
- select_blocks: the selection (the streaming kernel);
- selected_path: the selected branch's path (tiled, per-query or block-centric), from T, h and l' alone, so that
  torch.compile's fake tensors decide it too;
- selected_forward, selected_backward: that path's kernels, the block-centric ones in Gluon for calls large enough;
- inverse_index_readers: whether a forward builds the inverse index, and for whom;
- side_stream: whether a call queues its independent branches on a second CUDA stream.

The stages themselves run in nsa.ops.custom_ops; without a GPU (Triton's CPU interpreter) every choice falls to
Triton, one stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .branches import BLOCKS, MODE_SEL, MODE_WIN, SEL_DENSE, SEL_PARTS, SEL_TILED, TILED, TOKEN, SelectedDQ
from .geometry import NSAGeometry
from .packing import PackedLayout
from .gluon import backward as gluon_backward
from .gluon import forward as gluon_forward
from .gluon import query_grad as gluon_query_grad
from .gluon import selected_backward as gluon_selected_backward
from .gluon import selected_forward as gluon_selected_forward
from .streams import SideStream
from .triton import query_grad as triton_query_grad
from .triton import selected_attention as triton_selected
from .triton import span_attention as triton_span
from .triton.common import deterministic, tile_sizes
from .triton.inverse_index import build_inverse_index
from .triton.selection import select_blocks_fwd
from .tuning import TUNING

# ---------------------------------------------------------------- choices


def side_stream(q: Tensor) -> SideStream:
    """The side stream of one NSA call on queries q: enabled on CUDA (TUNING.branch_streams) for calls of at least
    TUNING.branch_streams_min_elements elements of q, whose GPU time outweighs the fork's host bookkeeping, and at
    any size while a CUDA graph is captured: replays pay no host time for the fork and join, and small calls are
    where the branches leave most SMs idle."""
    enabled = q.device.type == "cuda" and TUNING.branch_streams and (
        q.numel() >= TUNING.branch_streams_min_elements or torch.cuda.is_current_stream_capturing())
    return SideStream(q.device, enabled)


def selected_path(seq_len: int, heads_per_group: int, sel_block: int, forward: bool = False) -> str:
    """TILED while the sequence has few selection blocks; otherwise TOKEN (forward and dQ by per-query gathers, the
    group's h heads fill the matrix rows) for large groups, BLOCKS for small ones. `forward`: the forward's path,
    which stays tiled up to TUNING.tiled_max_blocks_forward where the backward's (the default) may not."""
    large = heads_per_group >= TUNING.token_min_heads
    most = TUNING.tiled_max_blocks_large_groups if large else TUNING.tiled_max_blocks
    if forward:
        most = max(most, TUNING.tiled_max_blocks_forward)
    if -(-seq_len // sel_block) <= min(most, 64):  # the tiled kernels hold the choices as one 64-bit mask
        return TILED
    return TOKEN if large else BLOCKS


def inverse_index_readers(q: Tensor, k: Tensor, sel_block: int, needs_grad: bool) -> tuple[bool, bool]:
    """(whether the selected forward reads the inverse index, whether the forward builds it at all): also for a
    block-centric backward, which a tiled forward may precede. From metadata alone: the fake implementation of
    nsa::forward decides it too."""
    T, h = q.shape[1], q.shape[2] // k.shape[2]
    forward = selected_path(T, h, sel_block, forward=True) == BLOCKS
    return forward, forward or (needs_grad and selected_path(T, h, sel_block) == BLOCKS)


def _gluon_takes(layout: PackedLayout | None) -> bool:
    """Whether a call may go to a Gluon kernel at all: unpacked calls, and packed ones with TUNING.gluon_packed."""
    return layout is None or TUNING.gluon_packed


def _gluon_span(q: Tensor, layout: PackedLayout | None) -> bool:
    """Whether a span kernel (forward, dK/dV, dQ) may be Gluon's: _gluon_takes, and a call large enough that its
    GPU time, not the launch's host time, sets its pace (TUNING.gluon_span_min_elements)."""
    return _gluon_takes(layout) and q.numel() >= TUNING.gluon_span_min_elements


def _gluon_selected_forward(q: Tensor, k: Tensor, v: Tensor, sel_block: int) -> bool:
    return (TUNING.gluon_selected_forward and q.numel() >= TUNING.gluon_selected_forward_min_elements
            and gluon_selected_forward.supports(q, k, v, sel_block))


def _gluon_selected_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, sel_block: int, write_dq: bool) -> bool:
    return (TUNING.gluon_selected_backward and q.numel() >= TUNING.gluon_selected_backward_min_elements
            and gluon_selected_backward.supports(q, k, v, do, sel_block, write_dq))


# ---------------------------------------------------------------- selection


def select_blocks(q: Tensor, k_cmp: Tensor, lse_cmp: Tensor, scale: float, geometry: NSAGeometry,
                  layout: PackedLayout | None = None) -> Tensor:
    """Indices [B,T,G,n] (int64, ascending, -1 padded; document-relative with `layout`) from q, k_cmp and the
    compressed branch's lse."""
    return select_blocks_fwd(q, k_cmp, lse_cmp, scale, geometry, layout)


# ---------------------------------------------------------------- span branches and dQ


def span_forward(q: Tensor, k: Tensor, v: Tensor, mode: int, scale: float, geometry: NSAGeometry,
                 bits: Tensor | None = None, gated: tuple | None = None,
                 layout: PackedLayout | None = None) -> tuple[Tensor, ...]:
    """A span branch's output [B,T,H,Dv] (q's dtype) and log-sum-exp [B,T,H] (float32, -inf where nothing is
    visible). MODE_SEL needs the choices as span_attention.chosen_bits; with gated = (o_cmp, o_win, gates)
    (MODE_SEL), the gated sum of the three branches comes third. With `layout`, a packed stream's documents."""
    B, T, H, _ = q.shape
    o = q.new_empty(B, T, H, v.shape[-1])
    lse = q.new_empty(B, T, H, dtype=torch.float32)
    out = torch.empty_like(o) if gated is not None else o
    if TUNING.gluon_forward and _gluon_span(q, layout) and gluon_forward.supports(q, k, v, mode, geometry.sel_block,
                                                                                 layout):
        gluon_forward.launch(q, k, v, o, lse, mode, scale, geometry, *triton_span.selection_args(bits, q), gated, out,
                             layout)
    else:
        triton_span.forward(q, k, v, o, lse, mode, scale, geometry, bits, gated, out, layout)
    return (o, lse, out) if gated is not None else (o, lse)


def span_dkdv(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, mode: int, scale: float,
              geometry: NSAGeometry, bits: Tensor | None = None,
              layout: PackedLayout | None = None) -> tuple[Tensor, Tensor]:
    """(dK, dV) of one span branch (its dQ is query_grad's): float32 where programs split the rows (atomic sums, or
    in deterministic mode partial sums added in a fixed order), else in k's type. With `layout`, a packed stream's
    documents (compressed rows that hold no document's token get zero).

    do is the gradient of the gated sum; lse and delta [B,T,H] are the branch's gated ones from
    gating.gate_grads (lse - ln(gate), rowsum(do * o_branch)).
    """
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    gluon = (TUNING.gluon_backward and _gluon_span(q, layout)
             and gluon_backward.supports(q, k, v, do, mode, geometry.sel_block, layout))
    tiles = gluon_backward.config(Dk) if gluon else tile_sizes(q, Dk, Dv, "dkdv")
    rows = T * (H // G)
    if mode == MODE_WIN:  # a window key is seen by at most w queries: one program holds them
        splits, rows_per_split = 1, rows
    else:
        key_tiles = -(-NK // tiles["BLOCK_N"])
        splits, rows_per_split = triton_span.dkdv_splits(rows, key_tiles, B * G, tiles["BLOCK_M"], q.device)
    # Several splits: float32 atomic sums into one zeroed buffer, or in deterministic mode each split's partial in
    # its own slice (every program writes its slice), summed afterwards in split order. One split: a tile stored
    # once, rounded to the inputs' type in the kernel (no conversion pass over a float32 result).
    parts = splits if splits > 1 and deterministic() else 1
    alloc = torch.zeros if splits > parts else torch.empty
    dtype = torch.float32 if splits > 1 else k.dtype
    dk_out = alloc((parts, *k.shape), device=k.device, dtype=dtype)
    dv_out = alloc((parts, *v.shape), device=v.device, dtype=dtype)
    if NK > 0 and gluon:
        gluon_backward.launch(q, k, v, do, lse, delta, dk_out, dv_out, mode, scale, geometry,
                              *triton_span.selection_args(bits, q), splits, rows_per_split, layout)
    elif NK > 0:
        triton_span.dkdv(q, k, v, do, lse, delta, dk_out, dv_out, mode, scale, geometry, bits, splits, rows_per_split,
                         layout)
    return (dk_out.sum(0), dv_out.sum(0)) if parts > 1 else (dk_out[0], dv_out[0])


def query_grad(q: Tensor, do: Tensor, lse_g: Tensor, delta: Tensor, scale: float, geometry: NSAGeometry,
               cmp: tuple | None, win: tuple | None, sel: SelectedDQ, layout: PackedLayout | None = None) -> Tensor:
    """dQ [B,T,H,Dk] in q's dtype: the compressed ((k, v) or None), window ((k, v) or None) and selected branches;
    with `layout`, of a packed stream's documents.

    lse_g and delta [3,B,T,H] (cmp, sel, win) are gating.gate_grads's gated lse and dL/dg.
    """
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if (TUNING.gluon_query_grad and _gluon_span(q, layout)
            and gluon_query_grad.supports(q, do, cmp, win, sel, geometry.sel_block, layout)):
        gluon_query_grad.launch(q, do, dq, lse_g, delta, scale, geometry, cmp, win, sel, layout)
    else:
        triton_query_grad.launch(q, do, dq, lse_g, delta, scale, geometry, cmp, win, sel, layout)
    return dq


# ---------------------------------------------------------------- selected branch


def selected_forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, inverse: tuple, o_cmp: Tensor, o_win: Tensor,
                     gates: Tensor, scale: float, geometry: NSAGeometry,
                     layout: PackedLayout | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(o, o_sel, lse_sel): the selected branch and the gated sum of all three branches.

    `inverse` (from inverse_index.build_inverse_index, with the same `layout`) is read on the block-centric path.
    With `layout`, a packed stream's documents (document-relative indices).
    """
    B, T, H, _ = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    h, n, sel_block = H // G, indices.shape[-1], geometry.sel_block
    path = selected_path(T, h, sel_block, forward=True)
    if path == TILED:  # the tiled kernel writes the gated sum too
        bits = triton_span.chosen_bits(indices, geometry.num_selection_blocks(T))
        o_sel, lse_sel, o = span_forward(q, k, v, MODE_SEL, scale, geometry, bits, (o_cmp, o_win, gates), layout)
        return o, o_sel, lse_sel
    o = q.new_empty(B, T, H, Dv)
    o_sel = torch.empty_like(o)
    lse_sel = q.new_empty(B, T, H, dtype=torch.float32)
    opart = lsepart = lse_sel  # the block-centric partials; unused by the per-query path
    if path == TOKEN:
        triton_selected.token_forward(q, k, v, indices, o_sel, lse_sel, scale, sel_block, layout)
    else:
        opart = q.new_empty(B * G * T * n, h, Dv)
        lsepart = q.new_empty(B * G * T * n, h, dtype=torch.float32)
        if _gluon_takes(layout) and _gluon_selected_forward(q, k, v, sel_block):
            gluon_selected_forward.launch(q, k, v, inverse, opart, lsepart, scale, n, layout)
        else:
            triton_selected.block_partials(q, k, v, inverse, opart, lsepart, scale, sel_block, n, layout)
    triton_selected.finalize(opart, lsepart, indices, o_cmp, o_win, gates, o, o_sel, lse_sel, merge=path == BLOCKS)
    return o, o_sel, lse_sel


def selected_backward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, inverse: tuple, do: Tensor, lse: Tensor,
                      delta: Tensor, scale: float, geometry: NSAGeometry,
                      layout: PackedLayout | None = None) -> tuple[Tensor, Tensor, SelectedDQ]:
    """(dK, dV) (float32, or k's type where span_dkdv stores them once) and the branch's share of dQ as query_grad
    takes it. With `layout`, a packed stream's documents (`inverse` built with it too).

    do is the gradient of the gated sum; lse and delta [B,T,H] are the branch's gated ones from
    gating.gate_grads (lse_sel - ln(gate), rowsum(do * o_sel)).
    """
    B, T, H, Dk = q.shape
    G = k.shape[2]
    h, n, sel_block = H // G, indices.shape[-1], geometry.sel_block
    path = selected_path(T, h, sel_block)
    if path == TILED:
        bits = triton_span.chosen_bits(indices, geometry.num_selection_blocks(T))
        dk, dv = span_dkdv(q, k, v, do, lse, delta, MODE_SEL, scale, geometry, bits, layout)
        return dk, dv, SelectedDQ(SEL_TILED, k=k, v=v, choice=bits)
    token = path == TOKEN
    if token and inverse[0].numel() == 0:  # its dK/dV is block-centric too; a per-query forward built no index
        inverse = build_inverse_index(indices, T, sel_block, layout)
    item_key = inverse[0]
    partials = deterministic()
    alloc = torch.empty if partials else torch.zeros  # the sums below write every row, the atomics add into zeros
    dk_out = alloc(k.shape, device=k.device, dtype=torch.float32)
    dv_out = alloc(v.shape, device=v.device, dtype=torch.float32)
    # Deterministic mode: every item writes its block's partial dK/dV to a slot of its own, summed below in item
    # order, instead of adding it atomically into dk_out/dv_out (what several items of one block would race on).
    block_l = triton_selected.block_tile(sel_block)["BLOCK_L"]
    dk_acc, dv_acc = ((torch.empty(item_key.numel(), block_l, x.shape[-1], device=x.device, dtype=torch.float32)
                       for x in (k, v)) if partials else (dk_out, dv_out))
    gluon = _gluon_takes(layout) and _gluon_selected_backward(q, k, v, do, sel_block, write_dq=not token)
    # The Gluon kernel adds the rows' dQ into one float32 dQ (less memory than per-slot shares, a float32 sum),
    # except in deterministic mode, whose sums need a fixed order: there it writes shares as Triton's does.
    dq_adds = gluon and not token and not partials
    if dq_adds:
        dqpart = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:
        dqpart = q if token else q.new_empty(B * G * T * n, h, Dk)
    if gluon:
        gluon_selected_backward.launch(q, k, v, do, lse, delta, dk_acc, dv_acc, dqpart, inverse, scale, n, not token,
                                       partials, dq_adds, layout)
    else:
        triton_selected.block_backward(q, k, v, do, lse, delta, dk_acc, dv_acc, dqpart, inverse, scale, sel_block,
                                       n, not token, partials, layout)
    if partials:
        for part, out in ((dk_acc, dk_out), (dv_acc, dv_out)):
            triton_selected.sum_item_partials(part, item_key, out, T, G, sel_block, layout)
    if dq_adds:
        return dk_out, dv_out, SelectedDQ(SEL_DENSE, choice=indices, dq=dqpart)
    if not token:
        return dk_out, dv_out, SelectedDQ(SEL_PARTS, choice=indices, parts=dqpart)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    triton_selected.token_dq(q, k, v, indices, do, lse, delta, dq, scale, sel_block, layout)
    return dk_out, dv_out, SelectedDQ(SEL_DENSE, choice=indices, dq=dq)
