"""phi's MLP (model/compression.py) as three Triton kernels, forward and backward, without unfolded blocks.

phi maps each block i of l tokens, x[i*d : i*d + l], to one compressed token:

    out_i = mean_j x[i*d + j] + W2 silu(h_i),    h_i = sum_j W1_j (x[i*d + j] + pos_j),

W1_j being the D columns of fc1 that read the block's j-th token. PyTorch computes this on unfolded blocks, a
copy that doubles the keys (stride d = l/2), then adds pos to it, pools it and differentiates through it with
further passes of the same size; those elementwise kernels cost ~2 ms of a 170 ms M7C training step at 2k x 32
(benchmarks/RESULTS.md, twenty-sixth session). Here each kernel reads the tokens where they lie:

- forward: one program per tile of blocks accumulates h over the l token positions (a tensor-core product per
  position), the mean beside it, then applies silu and fc2; it keeps h (float32) for the backward;
- backward rows: dh = (dy W2) * silu'(h), and fc2's weight gradient;
- backward tokens: each token's gradient gathers the r = l/d blocks that contain it (r in {1, 2});
- backward weights: fc1's and pos's gradients per token position j (pos enters fc1 only: its gradient is
  (colsum dh) W1_j), split over the blocks.

The weight gradients' partial sums are added by float32 atomics, or in deterministic mode summed in a fixed
order. Layouts: x [B,T,G,D] with unit last stride; out, h, dh [B,Nc,G,*] contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import deterministic, num_sms
from .tuning import TUNING


def phi_mlp_supports(block_len: int, block_stride: int) -> bool:
    """Whether these kernels serve this block geometry (each token in at most two blocks, blocks tiling it)."""
    return block_len % block_stride == 0 and block_len // block_stride in (1, 2)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _phi_fwd_kernel(X, POS, W1, W2, OUT, HID, sxb, sxt, sxg, n_blocks, G, stride,
                    L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = i < n_blocks
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    x_base = X + b * sxb + g * sxg
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(L):
        rows = (i * stride + j).to(tl.int64) * sxt
        xj = tl.load(x_base + rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        total += xj
        pos = tl.load(POS + j * D + d, mask=d_ok, other=0.0).to(tl.float32)
        w1 = tl.load(W1 + hh[None, :] * (L * D) + j * D + d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        acc = tl.dot((xj + pos[None, :]).to(W1.dtype.element_ty), w1, acc)
    out_rows = ((b * n_blocks + i) * G + g).to(tl.int64)
    tl.store(HID + out_rows[:, None] * H + hh[None, :], acc, mask=ok[:, None] & h_ok[None, :])
    s = acc * tl.sigmoid(acc)
    w2t = tl.load(W2 + d[None, :] * H + hh[:, None], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    out = total / L + tl.dot(s.to(X.dtype.element_ty), w2t.to(X.dtype.element_ty))
    tl.store(OUT + out_rows[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_bwd_rows_kernel(DY, HID, W2, DH, DH_SUM, DW2, n_rows, D: tl.constexpr, H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC: tl.constexpr):
    """dh = (dy W2) * silu'(h); its column sum over this program's rows into DH_SUM[program]; and fc2's weight
    gradient dy^T silu(h) over them, added into DW2[0] (ATOMIC) or written to DW2[program]."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    dy = tl.load(DY + rows[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    w2 = tl.load(W2 + d[:, None] * H + hh[None, :], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
    ds = tl.dot(dy, w2.to(dy.dtype))
    mask = ok[:, None] & h_ok[None, :]
    h = tl.load(HID + rows[:, None] * H + hh[None, :], mask=mask, other=0.0)
    sig = tl.sigmoid(h)
    dh = (ds * sig * (1 + h * (1 - sig))).to(DH.dtype.element_ty)
    tl.store(DH + rows[:, None] * H + hh[None, :], dh, mask=mask)
    tl.store(DH_SUM + tl.program_id(0) * H + hh, tl.sum(dh.to(tl.float32), 0), mask=h_ok)
    dw2 = tl.dot(tl.trans(dy), (h * sig).to(dy.dtype))  # rows past the end have dy = 0
    off = d[:, None] * H + hh[None, :]
    if ATOMIC:
        tl.atomic_add(DW2 + off, dw2, mask=d_ok[:, None] & h_ok[None, :], sem="relaxed")
    else:
        tl.store(DW2 + tl.program_id(0) * (D * H) + off, dw2, mask=d_ok[:, None] & h_ok[None, :])


@triton.jit
def _block_rows(DH, DY, b, blk, g, n_blocks, G, hh, d, h_ok, d_ok, valid, H: tl.constexpr, D: tl.constexpr):
    """dh [rows, BLOCK_H] and dy [rows, BLOCK_D] of blocks blk (0 where not `valid`)."""
    row = ((b * n_blocks + blk) * G + g).to(tl.int64)
    dh = tl.load(DH + row[:, None] * H + hh[None, :], mask=valid[:, None] & h_ok[None, :], other=0.0)
    dy = tl.load(DY + row[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    return dh, dy.to(tl.float32)


@triton.jit
def _phi_bwd_tokens_kernel(DH, DY, W1, DX, sdb, sdt, sdg, T, n_blocks, G, stride,
                           L: tl.constexpr, R: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx for the tokens of BLOCK_C chunks of `stride` tokens: chunk c lies in blocks c (at positions 0..d-1) and,
    with R = 2, c - 1 (at positions d..2d-1)."""
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    dh0, dy0 = _block_rows(DH, DY, b, c, g, n_blocks, G, hh, d, h_ok, d_ok, c < n_blocks, H, D)
    if R == 2:
        dh1, dy1 = _block_rows(DH, DY, b, c - 1, g, n_blocks, G, hh, d, h_ok, d_ok, (c >= 1) & (c - 1 < n_blocks),
                               H, D)
        mean_part = (dy0 + dy1) / L
    else:
        mean_part = dy0 / L
    x_base = DX + b * sdb + g * sdg
    for j in range(stride):
        w1 = tl.load(W1 + hh[:, None] * (L * D) + j * D + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        dx = tl.dot(dh0, w1.to(dh0.dtype), mean_part)
        if R == 2:
            w1b = tl.load(W1 + hh[:, None] * (L * D) + (j + stride) * D + d[None, :],
                          mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            dx = tl.dot(dh1, w1b.to(dh1.dtype), dx)
        t = c * stride + j
        t_ok = t < T
        tl.store(x_base + t.to(tl.int64)[:, None] * sdt + d[None, :], dx.to(DX.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_bwd_w1_kernel(DH, X, POS, W1, DH_SUM, DW1, DPOS, sxb, sxt, sxg, n_rows, rows_per_split, n_sums, n_blocks,
                       G, stride, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    """For token position j, over this split's blocks: fc1's weight gradient dh^T (x[block's j-th token] + pos_j)
    (fc1's input as the forward rounded it) into DW1[split, :, j*D:(j+1)*D], or with ATOMIC added into split 0's.
    Split 0 also writes pos_j's gradient (colsum dh) W1_j from the row kernel's n_sums column sums."""
    j = tl.program_id(0)
    split = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    hh = tl.arange(0, BLOCK_H)
    d_ok = d < D
    h_ok = hh < H
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    pos = tl.load(POS + j * D + d, mask=d_ok, other=0.0).to(tl.float32)
    for m0 in range(start, end, BLOCK_K):
        m = m0 + tl.arange(0, BLOCK_K)
        ok = m < end
        b = (m // (n_blocks * G)).to(tl.int64)
        i = (m // G) % n_blocks
        g = m % G
        dht = tl.load(DH + m.to(tl.int64)[None, :] * H + hh[:, None], mask=h_ok[:, None] & ok[None, :], other=0.0)
        x_off = b * sxb + (i * stride + j).to(tl.int64) * sxt + g * sxg
        x = tl.load(X + x_off[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(dht, (x + pos[None, :]).to(dht.dtype), acc)  # rows past the end meet dh = 0
    off = hh[:, None] * (L * D) + j * D + d[None, :]
    w_mask = h_ok[:, None] & d_ok[None, :]
    if ATOMIC:
        tl.atomic_add(DW1 + off, acc, mask=w_mask, sem="relaxed")
    else:
        tl.store(DW1 + split * (H * L * D) + off, acc, mask=w_mask)
    if split == 0:
        dh_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        for p0 in range(0, n_sums, BLOCK_K):
            p = p0 + tl.arange(0, BLOCK_K)
            part = tl.load(DH_SUM + p[:, None] * H + hh[None, :], mask=(p < n_sums)[:, None] & h_ok[None, :],
                           other=0.0)
            dh_sum += tl.sum(part, 0)
        w1 = tl.load(W1 + off, mask=w_mask, other=0.0).to(tl.float32)
        tl.store(DPOS + j * D + d, tl.sum(dh_sum[:, None] * w1, 0), mask=d_ok)


def _launch_shape(x: Tensor, hidden: int) -> tuple[int, int, int]:
    block_m = TUNING.phi_block_m if x.is_cuda else 16  # several programs in CPU tests too
    return block_m, _pow2(x.shape[-1]), _pow2(hidden)


@torch.library.custom_op("nsa::phi_mlp", mutates_args=())
def phi_mlp_forward(x: Tensor, pos: Tensor, w1: Tensor, w2: Tensor, block_len: int,
                    block_stride: int) -> tuple[Tensor, Tensor]:
    """(out [B,Nc,G,D] in x's type, h [B,Nc,G,H] float32 for the backward). pos, w1 and w2 may be wider than x
    (float32 parameters under autocast): the kernels round pos and w2 as they load them (once a program), w1 is
    rounded here (its inner loops would pay for wide loads: the forward and token-gradient kernels ran 1.5-1.9x
    slower, H100, M7C 2k x 32). Their gradients come back in their own types, with no casts either way."""
    B, T, G, D = x.shape
    H = w1.shape[0]
    n_blocks = (T - block_len) // block_stride + 1
    out = x.new_empty(B, n_blocks, G, D)
    hid = x.new_empty(B, n_blocks, G, H, dtype=torch.float32)
    block_m, block_d, block_h = _launch_shape(x, H)
    grid = (triton.cdiv(n_blocks, block_m), B * G)
    _phi_fwd_kernel[grid](x, pos, w1.to(x.dtype), w2, out, hid, x.stride(0), x.stride(1), x.stride(2), n_blocks, G, block_stride,
                          L=block_len, D=D, H=H, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_M=block_m,
                          num_warps=TUNING.phi_warps)
    return out, hid


@phi_mlp_forward.register_fake
def _(x, pos, w1, w2, block_len, block_stride):
    B, T, G, D = x.shape
    n_blocks = (T - block_len) // block_stride + 1
    return x.new_empty(B, n_blocks, G, D), x.new_empty(B, n_blocks, G, w1.shape[0], dtype=torch.float32)


def _splits(n_rows: int, block_len: int, x: Tensor) -> int:
    """Row splits of fc1's weight gradient: enough programs for every SM, each at least phi_w1_rows rows."""
    if not x.is_cuda:
        return min(4, triton.cdiv(n_rows, 16))  # several splits in CPU tests
    return max(1, min(triton.cdiv(2 * num_sms(x.device), block_len), triton.cdiv(n_rows, TUNING.phi_w1_rows)))


@torch.library.custom_op("nsa::phi_mlp_backward", mutates_args=())
def phi_mlp_backward(dy: Tensor, x: Tensor, pos: Tensor, w1: Tensor, w2: Tensor, hid: Tensor, block_len: int,
                     block_stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (x, pos, w1, w2), each in its input's type."""
    dy = dy.contiguous()
    B, T, G, D = x.shape
    n_blocks, H = hid.shape[1], hid.shape[3]
    n_rows = B * n_blocks * G
    block_m, block_d, block_h = _launch_shape(x, H)
    row_programs = triton.cdiv(n_rows, block_m)
    splits = _splits(n_rows, block_len, x)
    # The weight gradients' partial sums: float32 atomics add them in no fixed order; deterministic mode writes
    # one slice per program and sums them in order.
    atomic = not deterministic()
    w_slots, w2_slots = (1, 1) if atomic else (splits, row_programs)
    alloc = x.new_zeros if atomic else x.new_empty
    dw1, dw2 = (alloc(n, *w.shape, dtype=torch.float32) for n, w in ((w_slots, w1), (w2_slots, w2)))
    dpos = x.new_empty(pos.shape, dtype=torch.float32)
    dh = torch.empty_like(hid, dtype=x.dtype)
    dh_sums = x.new_empty(row_programs, H, dtype=torch.float32)
    _phi_bwd_rows_kernel[(row_programs,)](dy, hid, w2, dh, dh_sums, dw2, n_rows, D=D, H=H, BLOCK_D=block_d,
                                          BLOCK_H=block_h, BLOCK_M=block_m, ATOMIC=atomic,
                                          num_warps=TUNING.phi_warps)
    dx = torch.empty_like(x)
    n_chunks = triton.cdiv(T, block_stride)
    grid = (triton.cdiv(n_chunks, block_m), B * G)
    _phi_bwd_tokens_kernel[grid](dh, dy, w1.to(x.dtype), dx, dx.stride(0), dx.stride(1), dx.stride(2), T, n_blocks, G,
                                 block_stride, L=block_len, R=block_len // block_stride, D=D, H=H, BLOCK_D=block_d,
                                 BLOCK_H=block_h, BLOCK_C=block_m, num_warps=TUNING.phi_warps)
    _phi_bwd_w1_kernel[(block_len, splits)](dh, x, pos, w1, dh_sums, dw1, dpos, x.stride(0), x.stride(1),
                                            x.stride(2), n_rows, triton.cdiv(n_rows, splits), row_programs, n_blocks,
                                            G, block_stride, L=block_len, D=D, H=H, BLOCK_D=block_d, BLOCK_H=block_h,
                                            BLOCK_K=block_m, ATOMIC=atomic, num_warps=TUNING.phi_warps)
    dw1, dw2 = (g[0] if g.shape[0] == 1 else g.sum(0) for g in (dw1, dw2))
    return dx, *(g.to(w.dtype) for g, w in ((dpos, pos), (dw1, w1), (dw2, w2)))


@phi_mlp_backward.register_fake
def _(dy, x, pos, w1, w2, hid, block_len, block_stride):
    return torch.empty_like(x), torch.empty_like(pos), torch.empty_like(w1), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, pos, w1, w2, block_len, block_stride = inputs
    ctx.save_for_backward(x, pos, w1, w2, output[1])
    ctx.geometry = (block_len, block_stride)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _unused):
    return (*phi_mlp_backward(dy, *ctx.saved_tensors, *ctx.geometry), None, None)


phi_mlp_forward.register_autograd(_backward, setup_context=_setup_context)


def phi_mlp_triton(x: Tensor, pos: Tensor, w1: Tensor, w2: Tensor, block_len: int, block_stride: int) -> Tensor:
    """mean + W2 silu(W1 (block + pos)) of each block of x [B,T,G,D] (T >= block_len), in x's type."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    pos, w1, w2 = (p.contiguous() for p in (pos, w1, w2))
    return phi_mlp_forward(x, pos, w1, w2, block_len, block_stride)[0]
