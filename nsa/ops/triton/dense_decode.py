"""Dense decode attention split over the context (FlashDecoding): one new query per sequence over a key/value
cache, the dense model's decode step.

One query row per (sequence, key/value group) would leave the GPU idle at batch 1, and at 64k tokens one
program would walk every cached token in series. The cache is cut into splits of `TUNING.dense_decode_split`
tokens instead, in two launches (the group's h heads packed into the rows of one tile):
  A. one program per (split, sequence, group): a partial softmax (max, sum, p @ v in log2 units) over the
     split's tokens <= t; a split past t stores an empty partial;
  B. one program per (sequence, group, DVT output columns): merges the splits (common.merge_partials) and
     writes o.
Each cached key and value up to t is read once. Shapes depend on the cache's capacity only, so a step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import TUNING
from . import launcher
from .common import LOG2E, ceil_div, dot_precision, load_tile, merge_partials, next_power_of_two

_BLOCK_N = 64  # keys a step inside a split


@triton.jit
def _split_kernel(
    Q, K, V, POS, PM, PL, PACC,
    sqb, sqh, skb, skt, skg, svb, svt, svg,
    G, h, NS, scale_log2,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, HP: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // G).to(tl.int64)
    g = pid % G
    t = tl.load(POS + b).to(tl.int32)
    dk, dv, rh = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, HP)
    row_ok = rh < h
    q = load_tile(Q + b * sqb, (g * h + tl.where(row_ok, rh, 0)).to(tl.int64) * sqh, dk, row_ok, DK)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, t + 1)  # at most start: no step, an empty partial
    for k0 in range(start, end, BLOCK_N):
        kidx = k0 + tl.arange(0, BLOCK_N)
        k_ok = kidx < end
        k = load_tile(K + b * skb + g * skg, kidx.to(tl.int64) * skt, dk, k_ok, DK)
        v = load_tile(V + b * svb + g * svg, kidx.to(tl.int64) * svt, dv, k_ok, DV)
        s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2).to(tl.float32)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    row = (pid * NS + split).to(tl.int64) * HP + rh  # partial (sequence and group, split, head)
    tl.store(PM + row, m_i, mask=row_ok)
    tl.store(PL + row, l_i, mask=row_ok)
    tl.store(PACC + row[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(
    PM, PL, PACC, O, sob, soh, G, h, NS,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, HP: tl.constexpr, PT: tl.constexpr, DVT: tl.constexpr,
):
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * DVT
    b = (pid // G).to(tl.int64)
    g = pid % G
    _, l_i, acc = merge_partials(PM, PL, PACC, pid * NS, NS, h, HP, BLOCK_DV, PT, c0, DVT)
    rh = tl.arange(0, HP)
    dv = c0 + tl.arange(0, DVT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every row sees token 0 at least
    ptr = O + b * sob + (g * h + rh).to(tl.int64)[:, None] * soh + dv[None, :]
    tl.store(ptr, out.to(O.dtype.element_ty), mask=(rh < h)[:, None] & (dv < DV)[None, :])


def dense_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """o [B,H,Dv] (q's dtype): causal GQA attention of the queries q [B,H,Dk] at positions [B] over the cached
    keys k [B,L,G,Dk] and values v [B,L,G,Dv] (unit last stride) up to and including each position."""
    B, H, Dk = q.shape
    L, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    h = H // G
    split = TUNING.dense_decode_split
    if split % _BLOCK_N:
        raise ValueError(f"TUNING.dense_decode_split must be a multiple of {_BLOCK_N}, got {split}")
    n_splits = ceil_div(L, split)
    HP = max(16, next_power_of_two(h))
    BLOCK_DK, BLOCK_DV = max(16, next_power_of_two(Dk)), max(16, next_power_of_two(Dv))
    f32 = dict(device=q.device, dtype=torch.float32)
    pm, pl = torch.empty(B * G, n_splits, HP, **f32), torch.empty(B * G, n_splits, HP, **f32)
    pacc = torch.empty(B * G, n_splits, HP, BLOCK_DV, **f32)
    o = torch.empty(B, H, Dv, device=q.device, dtype=q.dtype)
    warps = dict(num_warps=4 if q.is_cuda else 1)
    launcher.launch(_split_kernel, (n_splits, B * G),
        q, k, v, positions, pm, pl, pacc, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), G, h, n_splits, scale * LOG2E, DK=Dk, DV=Dv, BLOCK_DK=BLOCK_DK,
        BLOCK_DV=BLOCK_DV, HP=HP, SPLIT=split, BLOCK_N=_BLOCK_N, DOT_PRECISION=dot_precision(q.dtype), **warps)
    dvt = min(BLOCK_DV, 32)
    launcher.launch(_merge_kernel, (B * G, BLOCK_DV // dvt),
        pm, pl, pacc, o, o.stride(0), o.stride(1), G, h, n_splits, DV=Dv, BLOCK_DV=BLOCK_DV, HP=HP,
        PT=min(16, next_power_of_two(n_splits)), DVT=dvt, **warps)
    return o
