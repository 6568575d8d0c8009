"""phi's MLP (model/compression.py) as three Triton kernels, forward and backward, without unfolded blocks.

phi maps each block i of l tokens, x[i*d : i*d + l], to one compressed token:

    out_i = mean_j x[i*d + j] + W2 silu(h_i),    h_i = sum_j W1_j (x[i*d + j] + pos_j),

W1_j being the D columns of fc1 that read the block's j-th token. PyTorch computes this on unfolded blocks, a
copy that doubles the keys (stride d = l/2), then adds pos to it, pools it and differentiates through it with
further passes of the same size. Here each kernel reads the tokens where they lie:

- forward: one program per tile of blocks accumulates h over the l token positions (a tensor-core product per
  position), the mean beside it, then applies silu and fc2; it keeps h (float32) for the backward;
- backward rows: dh = (dy W2) * silu'(h), and fc2's weight gradient;
- backward tokens: each token's gradient gathers the r = l/d blocks that contain it (r in {1, 2});
- backward weights: fc1's and pos's gradients per token position j (pos enters fc1 only: its gradient is
  (colsum dh) W1_j), split over the blocks.

The weight gradients' partial sums are added by float32 atomics, or in deterministic mode summed in a fixed
order. One launch serves the keys' and the values' phi together (a grid axis picks the set): alone, each
kernel's grid is too small to fill a large GPU at training shapes. Layouts: x [B,T,G,D] with unit last stride;
out, h, dh [S,B,Nc,G,*] contiguous, S the number of sets (1 or 2).

Packed documents (x [1,total,G,D], PACKED: a constexpr, so unpacked launches compile as before): blocks form inside
each document, and the tables of packing.CompressionLayout say where. Row i compresses the block starting at
row_start[i] (each document's rows back to back; rows past them hold none, get out = h = 0 and pass no gradient);
the token gradient cuts each document into chunks of d tokens from its first token (chunk_start), chunk k lying in
the document's blocks k and k - 1 where those exist. The same grids serve every packing (Nc(total) rows, a static
bound on the chunks): one launch per kernel, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..packing import CompressionLayout
from ..tuning import TUNING
from . import launcher
from .common import ceil_div, deterministic, dot_precision, dot_width, eager_call, ieee_products, num_sms


def phi_mlp_supports(block_len: int, block_stride: int) -> bool:
    """Whether these kernels serve this block geometry (each token in at most two blocks, blocks tiling it)."""
    return block_len % block_stride == 0 and block_len // block_stride in (1, 2)


@triton.jit
def _pick(which, first, second):
    """first for set 0, second for set 1 (pointers or strides)."""
    if which == 0:
        chosen = first
    else:
        chosen = second
    return chosen


@triton.jit
def _phi_fwd_kernel(X0, X1, POS0, POS1, W1_0, W1_1, W2_0, W2_1, OUT, HID, ROW_START, sxb0, sxt0, sxg0, sxb1, sxt1,
                    sxg1, B, T, n_blocks, G, stride, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, PACKED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """With PACKED, row i compresses the block that starts at token ROW_START[i]; rows that hold none (start T)
    get out = 0 and h = 0."""
    which = tl.program_id(2)
    X, POS, W1, W2 = _pick(which, X0, X1), _pick(which, POS0, POS1), _pick(which, W1_0, W1_1), _pick(which, W2_0, W2_1)
    sxb, sxt, sxg = _pick(which, sxb0, sxb1), _pick(which, sxt0, sxt1), _pick(which, sxg0, sxg1)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = i < n_blocks
    if PACKED:
        start = tl.load(ROW_START + i, mask=ok, other=T)
        live = start < T
    else:
        live = ok
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    x_base = X + b * sxb + g * sxg
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(L):
        if PACKED:
            rows = (start + j).to(tl.int64) * sxt
        else:
            rows = (i * stride + j).to(tl.int64) * sxt
        xj = tl.load(x_base + rows[:, None] + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0).to(
            tl.float32)
        total += xj
        pos = tl.load(POS + j * D + d, mask=d_ok, other=0.0).to(tl.float32)
        w1 = tl.load(W1 + hh[None, :] * (L * D) + j * D + d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        acc = tl.dot((xj + pos[None, :]).to(W1.dtype.element_ty), w1, acc, input_precision=DOT_PRECISION)
    if PACKED:
        acc = tl.where(live[:, None], acc, 0.0)  # with total = 0, out = 0: silu(0) = 0
    out_rows = (((which * B + b) * n_blocks + i) * G + g).to(tl.int64)
    tl.store(HID + out_rows[:, None] * H + hh[None, :], acc, mask=ok[:, None] & h_ok[None, :])
    s = acc * tl.sigmoid(acc)
    w2t = tl.load(W2 + d[None, :] * H + hh[:, None], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    out = total / L + tl.dot(s.to(X.dtype.element_ty), w2t.to(X.dtype.element_ty), input_precision=DOT_PRECISION)
    tl.store(OUT + out_rows[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_bwd_rows_kernel(DY, HID, W2_0, W2_1, DH, DH_SUM, DW2, ROW_START, n_rows, n_slots, T, n_blocks, G,
                         D: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_M: tl.constexpr, ATOMIC: tl.constexpr, PACKED: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """dh = (dy W2) * silu'(h); its column sum over this program's rows into DH_SUM[set, program]; and fc2's
    weight gradient dy^T silu(h) over them, added into DW2[set, 0] (ATOMIC) or written to DW2[set, program].
    With PACKED, rows that hold no compressed token (ROW_START T) read dy = 0, so their dh is 0."""
    which = tl.program_id(1)
    W2 = _pick(which, W2_0, W2_1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = rows < n_rows
    if PACKED:
        live = ok & (tl.load(ROW_START + (rows // G) % n_blocks, mask=ok, other=T) < T)
    else:
        live = ok
    rows += which.to(tl.int64) * n_rows
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    dy = tl.load(DY + rows[:, None] * D + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
    w2 = tl.load(W2 + d[:, None] * H + hh[None, :], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
    ds = tl.dot(dy, w2.to(dy.dtype), input_precision=DOT_PRECISION)
    mask = ok[:, None] & h_ok[None, :]
    h = tl.load(HID + rows[:, None] * H + hh[None, :], mask=mask, other=0.0)
    sig = tl.sigmoid(h)
    dh = (ds * sig * (1 + h * (1 - sig))).to(DH.dtype.element_ty)
    tl.store(DH + rows[:, None] * H + hh[None, :], dh, mask=mask)
    program = which * tl.num_programs(0) + tl.program_id(0)
    tl.store(DH_SUM + program * H + hh, tl.sum(dh.to(tl.float32), 0), mask=h_ok)
    dw2 = tl.dot(tl.trans(dy), (h * sig).to(dy.dtype), input_precision=DOT_PRECISION)  # rows past the end: dy = 0
    off = d[:, None] * H + hh[None, :]
    if ATOMIC:
        tl.atomic_add(DW2 + which * n_slots * (D * H) + off, dw2, mask=d_ok[:, None] & h_ok[None, :], sem="relaxed")
    else:
        tl.store(DW2 + program * (D * H) + off, dw2, mask=d_ok[:, None] & h_ok[None, :])


@triton.jit
def _block_rows(DH, DY, b, blk, g, n_blocks, G, hh, d, h_ok, d_ok, valid, H: tl.constexpr, D: tl.constexpr):
    """dh [rows, BLOCK_H] and dy [rows, BLOCK_D] of blocks blk (0 where not `valid`); b counts sets' batches."""
    row = ((b * n_blocks + blk) * G + g).to(tl.int64)
    dh = tl.load(DH + row[:, None] * H + hh[None, :], mask=valid[:, None] & h_ok[None, :], other=0.0)
    dy = tl.load(DY + row[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    return dh, dy.to(tl.float32)


@triton.jit
def _phi_bwd_tokens_kernel(DH, DY, W1_0, W1_1, DX0, DX1, CHUNK_START, DOC_START, DOC_END, CMP_START, sdb, sdt, sdg,
                           B, T, n_blocks, n_chunks, G, stride, L: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                           H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                           PACKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dx for the tokens of BLOCK_C chunks of `stride` tokens: chunk c lies in blocks c (at positions 0..d-1) and,
    with R = 2, c - 1 (at positions d..2d-1). With PACKED, chunks are cut inside each document (CHUNK_START): the
    document's chunk k lies in its blocks k and k - 1, which exist below its block count, at rows CMP_START + k
    and CMP_START + k - 1."""
    which = tl.program_id(2)
    W1, DX = _pick(which, W1_0, W1_1), _pick(which, DX0, DX1)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    sb = which * B + b  # the batch row in the sets' stacked dh and dy
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    if PACKED:
        first = tl.load(CHUNK_START + c, mask=c < n_chunks, other=T)
        here = first < T
        doc = tl.load(DOC_START + first, mask=here, other=0)
        end = tl.load(DOC_END + first, mask=here, other=0)
        k = (first - doc) // stride
        length = end - doc
        blocks = tl.where(length >= L, (length - L) // stride + 1, 0)
        blk = tl.load(CMP_START + first, mask=here, other=0) + k
        dh0, dy0 = _block_rows(DH, DY, sb, blk, g, n_blocks, G, hh, d, h_ok, d_ok, here & (k < blocks), H, D)
    else:
        dh0, dy0 = _block_rows(DH, DY, sb, c, g, n_blocks, G, hh, d, h_ok, d_ok, c < n_blocks, H, D)
    if R == 2:
        if PACKED:
            dh1, dy1 = _block_rows(DH, DY, sb, blk - 1, g, n_blocks, G, hh, d, h_ok, d_ok,
                                   here & (k >= 1) & (k - 1 < blocks), H, D)
        else:
            dh1, dy1 = _block_rows(DH, DY, sb, c - 1, g, n_blocks, G, hh, d, h_ok, d_ok,
                                   (c >= 1) & (c - 1 < n_blocks), H, D)
        mean_part = (dy0 + dy1) / L
    else:
        mean_part = dy0 / L
    x_base = DX + b * sdb + g * sdg
    for j in range(stride):
        w1 = tl.load(W1 + hh[:, None] * (L * D) + j * D + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        dx = tl.dot(dh0, w1.to(dh0.dtype), mean_part, input_precision=DOT_PRECISION)
        if R == 2:
            w1b = tl.load(W1 + hh[:, None] * (L * D) + (j + stride) * D + d[None, :],
                          mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            dx = tl.dot(dh1, w1b.to(dh1.dtype), dx, input_precision=DOT_PRECISION)
        if PACKED:
            t = first + j
            t_ok = t < end
        else:
            t = c * stride + j
            t_ok = t < T
        tl.store(x_base + t.to(tl.int64)[:, None] * sdt + d[None, :], dx.to(DX.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_bwd_w1_kernel(DH, X0, X1, POS0, POS1, W1_0, W1_1, DH_SUM, DW1, DPOS, ROW_START, sxb0, sxt0, sxg0, sxb1,
                       sxt1, sxg1, n_rows, rows_per_split, n_sums, T, n_blocks, G, stride, L: tl.constexpr,
                       D: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, PACKED: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """For token position j, over this split's blocks: fc1's weight gradient dh^T (x[block's j-th token] + pos_j)
    (fc1's input as the forward rounded it) into DW1[set, split, :, j*D:(j+1)*D], or with ATOMIC added into split
    0's. Split 0 also writes pos_j's gradient (colsum dh) W1_j from the row kernel's n_sums column sums. With
    PACKED, block i starts at ROW_START[i]; rows that hold none have dh = 0."""
    j = tl.program_id(0)
    split = tl.program_id(1)
    which = tl.program_id(2)
    X, POS, W1 = _pick(which, X0, X1), _pick(which, POS0, POS1), _pick(which, W1_0, W1_1)
    sxb, sxt, sxg = _pick(which, sxb0, sxb1), _pick(which, sxt0, sxt1), _pick(which, sxg0, sxg1)
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    pos = tl.load(POS + j * D + d, mask=d_ok, other=0.0).to(tl.float32)
    dh_set = DH + which.to(tl.int64) * n_rows * H
    for m0 in range(start, end, BLOCK_K):
        m = m0 + tl.arange(0, BLOCK_K)
        ok = m < end
        b = (m // (n_blocks * G)).to(tl.int64)
        i = (m // G) % n_blocks
        g = m % G
        dht = tl.load(dh_set + m.to(tl.int64)[None, :] * H + hh[:, None], mask=h_ok[:, None] & ok[None, :],
                      other=0.0)
        if PACKED:
            first = tl.load(ROW_START + i, mask=ok, other=T)
            live = ok & (first < T)
            x_off = b * sxb + (first + j).to(tl.int64) * sxt + g * sxg
        else:
            live = ok
            x_off = b * sxb + (i * stride + j).to(tl.int64) * sxt + g * sxg
        x = tl.load(X + x_off[:, None] + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(dht, (x + pos[None, :]).to(dht.dtype), acc, input_precision=DOT_PRECISION)  # dh = 0 past the end
    off = hh[:, None] * (L * D) + j * D + d[None, :]
    w_mask = h_ok[:, None] & d_ok[None, :]
    slots = 1 if ATOMIC else tl.num_programs(1)
    slot = which * slots + (0 if ATOMIC else split)
    if ATOMIC:
        tl.atomic_add(DW1 + slot * (H * L * D) + off, acc, mask=w_mask, sem="relaxed")
    else:
        tl.store(DW1 + slot * (H * L * D) + off, acc, mask=w_mask)
    if split == 0:
        dh_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        for p0 in range(0, n_sums, BLOCK_K):
            p = p0 + tl.arange(0, BLOCK_K)
            part = tl.load(DH_SUM + (which * n_sums + p)[:, None] * H + hh[None, :],
                           mask=(p < n_sums)[:, None] & h_ok[None, :], other=0.0)
            dh_sum += tl.sum(part, 0)
        w1 = tl.load(W1 + off, mask=w_mask, other=0.0).to(tl.float32)
        tl.store(DPOS + which * (L * D) + j * D + d, tl.sum(dh_sum[:, None] * w1, 0), mask=d_ok)


def _warps(x: Tensor) -> int:
    return 8 if ieee_products(x) else TUNING.phi_warps  # IEEE products: 8 warps spread the operands (ieee_products)


def _launch_shape(x: Tensor, hidden: int) -> tuple[int, int, int]:
    # Several programs in CPU tests too; IEEE float32 products take small tiles (ieee_products).
    block_m = TUNING.phi_block_m if x.is_cuda and not ieee_products(x) else 16
    return block_m, dot_width(x.shape[-1]), dot_width(hidden)


def _n_blocks(T: int, block_len: int, block_stride: int) -> int:
    return (T - block_len) // block_stride + 1


def _phi_forward_stages(x0: Tensor, x1: Tensor, pos0: Tensor, pos1: Tensor, w1_0: Tensor, w1_1: Tensor,
                        w2_0: Tensor, w2_1: Tensor, row_start: Tensor | None, chunk_start: Tensor | None,
                        doc_start: Tensor | None, doc_end: Tensor | None, cmp_start: Tensor | None, block_len: int,
                        block_stride: int, sets: int) -> tuple[Tensor, Tensor]:
    """nsa::phi_mlp's outputs (below), from its kernel."""
    B, T, G, D = x0.shape
    H = w1_0.shape[0]
    n_blocks = _n_blocks(T, block_len, block_stride)
    out = x0.new_empty(sets, B, n_blocks, G, D)
    hid = x0.new_empty(sets, B, n_blocks, G, H, dtype=torch.float32)
    block_m, block_d, block_h = _launch_shape(x0, H)
    grid = (ceil_div(n_blocks, block_m), B * G, sets)
    launcher.launch(_phi_fwd_kernel, grid,
                    x0, x1, pos0, pos1, w1_0.to(x0.dtype), w1_1.to(x0.dtype), w2_0, w2_1, out, hid, row_start,
                    *x0.stride()[:3], *x1.stride()[:3], B, T, n_blocks, G, block_stride, L=block_len, D=D,
                    H=H, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_M=block_m, PACKED=row_start is not None,
                    DOT_PRECISION=dot_precision(x0.dtype), num_warps=_warps(x0))
    return out, hid


@torch.library.custom_op("nsa::phi_mlp", mutates_args=())
def phi_mlp_forward(x0: Tensor, x1: Tensor, pos0: Tensor, pos1: Tensor, w1_0: Tensor, w1_1: Tensor, w2_0: Tensor,
                    w2_1: Tensor, row_start: Tensor | None, chunk_start: Tensor | None, doc_start: Tensor | None,
                    doc_end: Tensor | None, cmp_start: Tensor | None, block_len: int, block_stride: int,
                    sets: int) -> tuple[Tensor, Tensor]:
    """phi of `sets` (1 or 2) inputs x [B,T,G,D] of one shape, each with its own (pos, w1, w2) (set 1's arguments
    are ignored when sets = 1): (out [S,B,Nc,G,D] in x's type, h [S,B,Nc,G,H] float32 for the backward).

    Packed documents (B = 1) pass the five tables of packing.CompressionLayout (the forward reads row_start, the
    backward all five); without them, None.

    The weights may be wider than x (float32 parameters under autocast): the kernels round pos and w2 as they
    load them (once a program), w1 is rounded here and again in the backward (its inner loops would pay for
    wide loads). Their gradients come back in their own types, with no casts either way."""
    return _phi_forward_stages(x0, x1, pos0, pos1, w1_0, w1_1, w2_0, w2_1, row_start, chunk_start, doc_start,
                               doc_end, cmp_start, block_len, block_stride, sets)


@phi_mlp_forward.register_fake
def _(x0, x1, pos0, pos1, w1_0, w1_1, w2_0, w2_1, row_start, chunk_start, doc_start, doc_end, cmp_start, block_len,
      block_stride, sets):
    B, T, G, D = x0.shape
    n_blocks = _n_blocks(T, block_len, block_stride)
    return (x0.new_empty(sets, B, n_blocks, G, D),
            x0.new_empty(sets, B, n_blocks, G, w1_0.shape[0], dtype=torch.float32))


def _splits(n_rows: int, block_len: int, sets: int, x: Tensor) -> int:
    """Row splits of fc1's weight gradient: enough programs for every SM, each at least phi_w1_rows rows."""
    if not x.is_cuda:
        return min(4, ceil_div(n_rows, 16))  # several splits in CPU tests
    programs = 2 * num_sms(x.device)
    return max(1, min(ceil_div(programs, block_len * sets), ceil_div(n_rows, TUNING.phi_w1_rows)))


def _phi_backward_stages(dy: Tensor, x0: Tensor, x1: Tensor, pos0: Tensor, pos1: Tensor, w1_0: Tensor,
                         w1_1: Tensor, w2_0: Tensor, w2_1: Tensor, row_start: Tensor | None,
                         chunk_start: Tensor | None, doc_start: Tensor | None, doc_end: Tensor | None,
                         cmp_start: Tensor | None, hid: Tensor, block_len: int,
                         block_stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """nsa::phi_mlp_backward's gradients (below), from its kernels."""
    dy = dy.contiguous()
    sets, B, n_blocks, G, H = hid.shape
    T, D = x0.shape[1], x0.shape[3]
    n_rows = B * n_blocks * G
    packed = row_start is not None
    precision = dot_precision(x0.dtype)
    block_m, block_d, block_h = _launch_shape(x0, H)
    row_programs = ceil_div(n_rows, block_m)
    splits = _splits(n_rows, block_len, sets, x0)
    # The weight gradients' partial sums: float32 atomics add them in no fixed order; deterministic mode writes
    # one slice per program and sums them in order.
    atomic = not deterministic()
    w_slots, w2_slots = (1, 1) if atomic else (splits, row_programs)
    alloc = x0.new_zeros if atomic else x0.new_empty
    dw1, dw2 = (alloc(sets, n, *w.shape, dtype=torch.float32) for n, w in ((w_slots, w1_0), (w2_slots, w2_0)))
    dpos = x0.new_empty(sets, *pos0.shape, dtype=torch.float32)
    dh = torch.empty_like(hid, dtype=x0.dtype)
    dh_sums = x0.new_empty(sets, row_programs, H, dtype=torch.float32)
    launcher.launch(_phi_bwd_rows_kernel, (row_programs, sets),
                    dy, hid, w2_0, w2_1, dh, dh_sums, dw2, row_start, n_rows, w2_slots, T,
                    n_blocks, G, D=D, H=H, BLOCK_D=block_d, BLOCK_H=block_h,
                    BLOCK_M=block_m, ATOMIC=atomic, PACKED=packed, DOT_PRECISION=precision,
                    num_warps=_warps(x0))
    dx0 = torch.empty_like(x0)
    dx1 = torch.empty_like(x1) if sets == 2 else x0.new_empty(0)
    # Chunks of d tokens: the stream's, or with packed documents each document's (chunk_start).
    n_chunks = chunk_start.numel() if packed else ceil_div(T, block_stride)
    grid = (ceil_div(n_chunks, block_m), B * G, sets)
    launcher.launch(_phi_bwd_tokens_kernel, grid,
                    dh, dy, w1_0.to(x0.dtype), w1_1.to(x0.dtype), dx0, dx1 if sets == 2 else dx0,
                    chunk_start, doc_start, doc_end, cmp_start, *dx0.stride()[:3], B, T, n_blocks,
                    n_chunks, G, block_stride, L=block_len, R=block_len // block_stride, D=D, H=H,
                    BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_C=block_m, PACKED=packed,
                    DOT_PRECISION=precision, num_warps=_warps(x0),
                    # float32 tiles in Triton's 3 pipeline stages overrun sm_90's shared memory
                    # (benchmarks/offline_compile.py --float32); 16-bit ones keep the default.
                    num_stages=1 if x0.element_size() == 4 else 3)
    launcher.launch(_phi_bwd_w1_kernel, (block_len, splits, sets),
                    dh, x0, x1, pos0, pos1, w1_0, w1_1, dh_sums, dw1, dpos, row_start,
                    *x0.stride()[:3], *x1.stride()[:3], n_rows,
                    ceil_div(n_rows, splits), row_programs, T, n_blocks, G,
                    block_stride, L=block_len, D=D, H=H, BLOCK_D=block_d,
                    BLOCK_H=block_h, BLOCK_K=block_m, ATOMIC=atomic, PACKED=packed,
                    DOT_PRECISION=precision, num_warps=_warps(x0))
    dw1, dw2 = (g[:, 0] if g.shape[1] == 1 else g.sum(1) for g in (dw1, dw2))
    return dx0, dx1, *(g.to(w.dtype) for g, w in ((dpos, pos0), (dw1, w1_0), (dw2, w2_0)))


@torch.library.custom_op("nsa::phi_mlp_backward", mutates_args=())
def phi_mlp_backward(dy: Tensor, x0: Tensor, x1: Tensor, pos0: Tensor, pos1: Tensor, w1_0: Tensor, w1_1: Tensor,
                     w2_0: Tensor, w2_1: Tensor, row_start: Tensor | None, chunk_start: Tensor | None,
                     doc_start: Tensor | None, doc_end: Tensor | None, cmp_start: Tensor | None, hid: Tensor,
                     block_len: int, block_stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx0, dx1 (empty for one set), dpos [S,l,D], dw1 [S,H,l*D], dw2 [S,D,H]), each in its input's
    type; the weights' stacked by set."""
    return _phi_backward_stages(dy, x0, x1, pos0, pos1, w1_0, w1_1, w2_0, w2_1, row_start, chunk_start, doc_start,
                                doc_end, cmp_start, hid, block_len, block_stride)


@phi_mlp_backward.register_fake
def _(dy, x0, x1, pos0, pos1, w1_0, w1_1, w2_0, w2_1, row_start, chunk_start, doc_start, doc_end, cmp_start, hid,
      block_len, block_stride):
    sets = hid.shape[0]
    return (torch.empty_like(x0), torch.empty_like(x1) if sets == 2 else x0.new_empty(0),
            *(w.new_empty(sets, *w.shape) for w in (pos0, w1_0, w2_0)))


def _setup_context(ctx, inputs, output):
    *tensors, block_len, block_stride, _ = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.geometry = (block_len, block_stride)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


_NO_GRADS = (None,) * 8  # the five tables, block_len, block_stride, sets


def _input_grads(ctx, dy: Tensor, backward) -> tuple:
    """The gradients of the forward's inputs from `backward` (nsa::phi_mlp_backward or its stages)."""
    dx0, dx1, dpos, dw1, dw2 = backward(dy, *ctx.saved_tensors, *ctx.geometry)
    if dpos.shape[0] == 1:  # one set: its arguments stood in for set 1's
        return dx0, None, dpos[0], None, dw1[0], None, dw2[0], None, *_NO_GRADS
    return dx0, dx1, *dpos.unbind(), *dw1.unbind(), *dw2.unbind(), *_NO_GRADS


def _backward(ctx, dy, _unused):
    return _input_grads(ctx, dy, phi_mlp_backward)


phi_mlp_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerPhi(torch.autograd.Function):
    """nsa::phi_mlp's and nsa::phi_mlp_backward's kernels without the custom ops, for eager calls (less host time
    a call); torch.compile, export and fake tensors take the custom ops."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _phi_forward_stages(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dy, _unused):
        return _input_grads(ctx, dy, _phi_backward_stages)


def phi_mlp_triton(xs: tuple[Tensor, ...], params: tuple[tuple[Tensor, Tensor, Tensor], ...], block_len: int,
                   block_stride: int, layout: CompressionLayout | None = None) -> tuple[Tensor, ...]:
    """mean + W2 silu(W1 (block + pos)) of each block, for one or two inputs x [B,T,G,D] of one shape (T >=
    block_len), each with its (pos, w1, w2); in x's type, in one launch per kernel. With `layout` (packed
    documents, x [1,total,G,D]), the blocks inside each document, as model.compression.BlockCompressor lays them
    out: [1, Nc(total), G, D], zero on rows that hold no compressed token."""
    xs = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
    sets = len(xs)
    if sets not in (1, 2) or len(params) != sets or any(x.shape != xs[0].shape or x.dtype != xs[0].dtype
                                                         for x in xs):
        raise ValueError("phi_mlp_triton takes one or two inputs of one shape and type, each with its weights")
    if layout is not None and xs[0].shape[0] != 1:
        raise ValueError(f"packed documents come as one row [1, total, G, D], got x of shape {tuple(xs[0].shape)}")
    (pos0, w1_0, w2_0), (pos1, w1_1, w2_1) = params[0], params[-1]
    x0, x1 = xs[0], xs[-1]
    tables = (None,) * 5 if layout is None else layout.tensors()
    weights = [p.contiguous() for p in (pos0, pos1, w1_0, w1_1, w2_0, w2_1)]
    op = EagerPhi.apply if eager_call([x0, x1, *weights]) else phi_mlp_forward
    out = op(x0, x1, *weights, *tables, block_len, block_stride, sets)[0]
    return tuple(out.unbind(0))
