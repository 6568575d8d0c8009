"""Decode prep: everything an NSA decode step does between its input GEMM and its attention, in one launch.

A decode step's layer input goes through one matmul for all its input maps (nsa.inference.fused.input_rows):
row b holds sequence b's query projection [H*D], its key/value sets [S, 2, G, D] (S = n_kv_sets: 3 with one set per
branch, 1 with shared_kv) and the gate's first layer [hidden] (or, for a linear gate, the gate logits [3H]).
Under torch.compile the PyTorch path (NSAAttention.project_from, gates_from, NSALayerCache.write) becomes four or
five small kernels; at decode batch sizes each costs a launch and not its bytes. This kernel fuses them, for one
token per sequence at positions [B]:
  - the gates [B,H,3]: GateMLP.finish as nsa.inference.fused.gates_from computes it, in float32:
    silu(h) @ gate_out (or the logits as they are for a linear gate), then a sigmoid per branch or a softmax over
    the three (cmp, sel, win);
  - q [B,H,D]: the query projection RoPE'd (nsa.model.rope.apply_rope: rotate-half, in float32, with the
    caller's cos/sin [B, D/2] of each sequence's position);
  - the cache write of NSALayerCache.write: every set's keys RoPE'd like q and its values as they are, stored into
    k/v [S,B,L,G,D] at [s, b, positions[b]].
One program per (sequence, part): part 0 the gates, part 1 q, part 2 + s key/value set s.

Invariants:
  - q and gates come out in the rows' dtype, as the PyTorch step has them (project_from's q, gates cast to q's);
    keys are rounded to the rows' dtype and then to the cache's, as apply_rope and index_put_ round them; values are
    copied (exactly, when the cache's dtype is the rows').
  - Only k/v[:, b, positions[b]] are written; a position outside [0, L) writes nothing (the caller checks the
    capacity: nsa.inference.decode.advance).
  - No host sync and static shapes: the launch can be traced by torch.compile (the caches are mutated arguments
    of a user-defined Triton kernel) and captured in a CUDA graph.
The compressed emission (NSALayerCache.emit) is not part of it: it runs on emit steps only, after this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launcher
from .common import next_power_of_two


@triton.jit
def _rope_rows(SRC, DST, dst_stride, n_rows, c, s, ok, HALF: tl.constexpr, HALF_P: tl.constexpr,
               ROWS_P: tl.constexpr):
    """Rows r < n_rows of SRC (each of 2*HALF contiguous values, rows back to back) rotated by the angles whose
    cos/sin are c/s [HALF_P] (rotate-half: the first half pairs with the second), stored at DST + r*dst_stride,
    rounded to SRC's dtype first (apply_rope's result) and then to DST's."""
    r, i = tl.arange(0, ROWS_P), tl.arange(0, HALF_P)
    mask = ok & (r < n_rows)[:, None] & (i < HALF)[None, :]
    src = SRC + r[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    dst = DST + r[:, None].to(tl.int64) * dst_stride + i[None, :]
    tl.store(dst, y1.to(SRC.dtype.element_ty).to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(SRC.dtype.element_ty).to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _copy_rows(SRC, DST, dst_stride, n_rows, ok, D: tl.constexpr, D_P: tl.constexpr, ROWS_P: tl.constexpr):
    """Rows r < n_rows of SRC (D contiguous values each, back to back) stored at DST + r*dst_stride."""
    r, d = tl.arange(0, ROWS_P), tl.arange(0, D_P)
    mask = ok & (r < n_rows)[:, None] & (d < D)[None, :]
    x = tl.load(SRC + r[:, None] * D + d[None, :], mask=mask, other=0.0)
    tl.store(DST + r[:, None].to(tl.int64) * dst_stride + d[None, :], x.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _gate_logits(GATE, GATE_OUT, s_go, branch, H: tl.constexpr, HP: tl.constexpr, HIDDEN: tl.constexpr,
                 HIDDEN_P: tl.constexpr, MLP: tl.constexpr):
    """Logits [HP] of one branch for every head, in float32: silu(h) @ gate_out[:, head*3 + branch] from the gate's
    hidden units h = GATE[:HIDDEN], or GATE[head*3 + branch] for a linear gate."""
    hh = tl.arange(0, HP)
    col = hh * 3 + branch
    if MLP:
        k = tl.arange(0, HIDDEN_P)
        k_ok = k < HIDDEN
        h = tl.load(GATE + k, mask=k_ok, other=0.0).to(tl.float32)
        act = h / (1.0 + tl.exp(-h))  # silu
        w = tl.load(GATE_OUT + k[:, None] * s_go + col[None, :], mask=k_ok[:, None] & (hh < H)[None, :], other=0.0)
        return tl.sum(act[:, None] * w.to(tl.float32), axis=0)
    return tl.load(GATE + col, mask=hh < H, other=0.0).to(tl.float32)


@triton.jit
def _gates(GATE, GATE_OUT, s_go, OUT, s_oh, H: tl.constexpr, HP: tl.constexpr, HIDDEN: tl.constexpr,
           HIDDEN_P: tl.constexpr, MLP: tl.constexpr, SOFTMAX: tl.constexpr):
    """One sequence's gates OUT[head, branch] (head stride s_oh) from its gate row GATE."""
    l0 = _gate_logits(GATE, GATE_OUT, s_go, 0, H, HP, HIDDEN, HIDDEN_P, MLP)
    l1 = _gate_logits(GATE, GATE_OUT, s_go, 1, H, HP, HIDDEN, HIDDEN_P, MLP)
    l2 = _gate_logits(GATE, GATE_OUT, s_go, 2, H, HP, HIDDEN, HIDDEN_P, MLP)
    if SOFTMAX:
        m = tl.maximum(tl.maximum(l0, l1), l2)
        e0, e1, e2 = tl.exp(l0 - m), tl.exp(l1 - m), tl.exp(l2 - m)
        z = e0 + e1 + e2
        g0, g1, g2 = e0 / z, e1 / z, e2 / z
    else:
        g0, g1, g2 = tl.sigmoid(l0), tl.sigmoid(l1), tl.sigmoid(l2)
    hh = tl.arange(0, HP)
    out = OUT + hh * s_oh
    ok = hh < H
    tl.store(out, g0.to(OUT.dtype.element_ty), mask=ok)
    tl.store(out + 1, g1.to(OUT.dtype.element_ty), mask=ok)
    tl.store(out + 2, g2.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _decode_prep_kernel(
    ROWS, POS, COS, SIN, GATE_OUT, Q, GATES, K, V,
    s_row, s_cos, s_sin, s_go, s_qb, s_qh, s_gb, s_gh,
    sk_s, sk_b, sk_l, sk_g, sv_s, sv_b, sv_l, sv_g, L,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, HIDDEN: tl.constexpr,
    HP: tl.constexpr, GP: tl.constexpr, D_P: tl.constexpr, HALF_P: tl.constexpr, HIDDEN_P: tl.constexpr,
    MLP: tl.constexpr, SOFTMAX: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row = ROWS + b * s_row
    if part == 0:
        _gates(row + H * D + 2 * S * G * D, GATE_OUT, s_go, GATES + b * s_gb, s_gh, H, HP, HIDDEN, HIDDEN_P, MLP,
               SOFTMAX)
    else:
        i = tl.arange(0, HALF_P)
        c = tl.load(COS + b * s_cos + i, mask=i < D // 2, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * s_sin + i, mask=i < D // 2, other=0.0).to(tl.float32)
        if part == 1:
            _rope_rows(row, Q + b * s_qb, s_qh, H, c, s, part == 1, D // 2, HALF_P, HP)
        else:
            kv_set = part - 2
            t = tl.load(POS + b)
            ok = (t >= 0) & (t < L)
            t = tl.where(ok, t, 0)
            src = row + H * D + kv_set * (2 * G * D)
            _rope_rows(src, K + kv_set * sk_s + b * sk_b + t * sk_l, sk_g, G, c, s, ok, D // 2, HALF_P, GP)
            _copy_rows(src + G * D, V + kv_set * sv_s + b * sv_b + t * sv_l, sv_g, G, ok, D, D_P, GP)


def decode_prep(rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, gate_out: torch.Tensor | None, *, n_heads: int,
                gate_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,D] and gates [B,H,3] (both in rows' dtype) of one token per sequence; writes its keys and values into
    k/v [S,B,L,G,D] at positions [B].

    rows [B, H*D + S*2*G*D + W] (unit last stride): the layer's input GEMM output, one row per sequence, in
    input_projections' order (queries; sets of keys then values, [S, 2, G, D]; the gate's first layer, W = hidden
    units, or W = 3H gate logits for a linear gate). positions [B] (integer), cos/sin [B, D/2] float32 (unit last
    stride) of each sequence's position. gate_out [hidden, 3H] (unit last stride, float32) the gate MLP's second
    layer transposed, or None for a linear gate. gate_kind 'sigmoid' or 'softmax'.
    """
    B, S, G, D = rows.shape[0], k.shape[0], k.shape[3], k.shape[4]
    H = n_heads
    hidden = 3 * H if gate_out is None else gate_out.shape[0]
    _check(rows, positions, cos, sin, k, v, gate_out, H, hidden)
    q = torch.empty(B, H, D, device=rows.device, dtype=rows.dtype)
    gates = torch.empty(B, H, 3, device=rows.device, dtype=rows.dtype)
    table = gate_out if gate_out is not None else rows  # never read for a linear gate
    launcher.launch(_decode_prep_kernel, (B, 2 + S),
        rows, positions, cos, sin, table, q, gates, k, v,
        rows.stride(0), cos.stride(0), sin.stride(0), table.stride(0), q.stride(0), q.stride(1),
        gates.stride(0), gates.stride(1), *k.stride()[:4], *v.stride()[:4], k.shape[2],
        H=H, G=G, D=D, S=S, HIDDEN=hidden, HP=next_power_of_two(H), GP=next_power_of_two(G),
        D_P=next_power_of_two(D), HALF_P=next_power_of_two(D // 2), HIDDEN_P=next_power_of_two(hidden),
        MLP=gate_out is not None, SOFTMAX=gate_kind == "softmax", num_warps=2 if rows.is_cuda else 1)
    return q, gates


def _check(rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, gate_out: torch.Tensor | None, n_heads: int, hidden: int) -> None:
    """The shapes and layouts decode_prep reads its arguments with (static: no device value is read)."""
    B, S, G, D = rows.shape[0], k.shape[0], k.shape[3], k.shape[4]
    width = n_heads * D + 2 * S * G * D + hidden
    assert rows.dim() == 2 and rows.shape[1] == width and rows.stride(1) == 1, (rows.shape, width)
    assert k.shape == v.shape and k.shape[1] == B and k.stride(4) == 1 and v.stride(4) == 1 and D % 2 == 0
    assert positions.shape == (B,) and not positions.dtype.is_floating_point
    assert cos.shape == sin.shape == (B, D // 2) and cos.stride(1) == 1 and sin.stride(1) == 1
    assert gate_out is None or (gate_out.shape == (hidden, 3 * n_heads) and gate_out.stride(1) == 1)
