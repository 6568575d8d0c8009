"""dQ of all three branches in one pass, written once in q's dtype.

One program per tile of (token, head) rows (range_attention's layout). It loads the rows' q and
do once, walks the compressed keys and the window's keys (range_attention's masked-edge /
interior loops, each branch with its own gated lse and delta), and takes the selected branch's
share in whichever form its path left it:

- SEL_TILED (short T): the selected branch's causal tiles masked by the choices, walked here too;
- SEL_PARTS (block-centric path): the sum of the query's per-slot dQ partials;
- SEL_DENSE (per-token path): a float32 dQ the per-query kernel wrote;
- SEL_NONE: no selected branch (a branch timed alone).

On sm_90 GPUs the Gluon kernel of hopper_query_grad.py does the same (measured 1.2-1.5x faster).

One branch at a time meant reading q and do three times, a float32 dq written, read and
written again twice, then converted: at M7C's 2k x 16 sequences ~0.8 GB of traffic for a
50 MB result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import LOG2E, head_dims, load_tile, store_tile
from .hopper_query_grad import hopper_query_grad_supports, query_grad_hopper
from .range_attention import _blocks, _dq_keys, _key_plan, _rows
from .tuning import TUNING

SEL_NONE, SEL_TILED, SEL_PARTS, SEL_DENSE = 0, 1, 2, 3


@dataclass
class SelectedDQ:
    """The selected branch's share of dQ, as its backward left it (see the module docstring)."""

    kind: int
    k: torch.Tensor | None = None
    """SEL_TILED: the branch's keys [B,T,G,Dk] ..."""
    v: torch.Tensor | None = None
    """... and values."""
    choice: torch.Tensor | None = None
    """SEL_TILED: chosen_bits [B,T,G]; SEL_PARTS: the indices [B,T,G,n]."""
    parts: torch.Tensor | None = None
    """SEL_PARTS: per-(query, slot, head) partials [B*G*T*n, h, Dk], already scaled."""
    dq: torch.Tensor | None = None
    """SEL_DENSE: float32 [B,T,H,Dk], already scaled."""
    sel_block: int = 1

    def dense(self) -> torch.Tensor:
        """SEL_PARTS or SEL_DENSE as a float32 dQ [B,T,H,Dk] (the partials summed over the used slots; unused slots'
        partials are never written). For checks and benchmarks: query_grad reads the partials in place."""
        if self.kind == SEL_DENSE:
            return self.dq
        if self.kind != SEL_PARTS:
            raise ValueError(f"only the partials or a dense dQ can be summed, not kind {self.kind}")
        B, T, G, n = self.choice.shape
        h, Dk = self.parts.shape[1:]
        used = (self.choice.permute(0, 2, 1, 3) >= 0)[..., None, None]
        summed = torch.where(used, self.parts.float().view(B, G, T, n, h, Dk), 0.0).sum(3)
        return summed.permute(0, 2, 1, 3, 4).reshape(B, T, G * h, Dk)


@triton.jit
def _branch_dq(q, do, dq, LSE, DELTA, lse_off, row_ok, K, V, k_base, v_base, skt, svt, NK, pid_m, b, g, t, T,
               h: tl.constexpr, IDX, sib, sit, sig, block_len, block_stride, window, sel_block, dk, dv, scale_log2,
               MODE: tl.constexpr, ONE_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq plus one range branch's (unscaled) dQ for the program's rows."""
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    lo, hi, k_start, k_end, chosen, a, e = _key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE,
                                                     block_len, block_stride, window, BLOCK_M, BLOCK_N)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, k_start, a, lo, hi, row_ok, chosen,
                  sel_block, dk, dv, scale_log2, dq, True, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, a, e, lo, hi, row_ok, chosen,
                  sel_block, dk, dv, scale_log2, dq, False, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, e, k_end, lo, hi, row_ok, chosen,
                  sel_block, dk, dv, scale_log2, dq, True, MODE, ONE_BLOCK, DK, DV, BLOCK_N)
    return dq


@triton.jit
def _query_grad_kernel(
    Q, DO, DQ, LSE_C, DELTA_C, LSE_S, DELTA_S, LSE_W, DELTA_W, KC, VC, KS, VS, KW, VW, SEL_IDX, PARTS, DQ_SEL,
    sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdqb, sdqt, sdqh,
    skcb, skct, skcg, svcb, svct, svcg, sksb, skst, sksg, svsb, svst, svsg, skwb, skwt, skwg, svwb, svwt, svwg,
    sib, sit, sig, sdsb, sdst, sdsh,
    T, NC, G, h: tl.constexpr, n, scale_log2, scale, block_len, block_stride, window, sel_block,
    HAS_CMP: tl.constexpr, HAS_WIN: tl.constexpr, SEL: tl.constexpr, NP: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b, g, row_ok, t, head = _rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    do = load_tile(DO, b * sdob + t * sdot + head * sdoh, dv, row_ok, DV)
    lse_off = b * slb + t * slt + head
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    # The branches' modes are range_attention's MODE_CMP (0), MODE_WIN (1) and MODE_SEL (2).
    if HAS_CMP:
        dq = _branch_dq(q, do, dq, LSE_C, DELTA_C, lse_off, row_ok, KC, VC, b * skcb + g * skcg, b * svcb + g * svcg,
                        skct, svct, NC, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, 0, ONE_BLOCK, DK, DV, BLOCK_M, BLOCK_N)
    if HAS_WIN:
        dq = _branch_dq(q, do, dq, LSE_W, DELTA_W, lse_off, row_ok, KW, VW, b * skwb + g * skwg, b * svwb + g * svwg,
                        skwt, svwt, T, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, 1, ONE_BLOCK, DK, DV, BLOCK_M, BLOCK_N)
    if SEL == 1:
        dq = _branch_dq(q, do, dq, LSE_S, DELTA_S, lse_off, row_ok, KS, VS, b * sksb + g * sksg, b * svsb + g * svsg,
                        skst, svst, T, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, 2, ONE_BLOCK, DK, DV, BLOCK_M, BLOCK_N)
    dq = dq * scale
    # The selected branch's ready-made share last, so that none of it is live through the loops above.
    if SEL == 2:
        part0 = (((b * G + g) * T + t) * n) * h + (head - g * h)  # slot s of the row: part0 + s * h
        for s in tl.static_range(NP):  # unrolled, so the slots' reads do not wait on each other
            j = tl.load(SEL_IDX + b * sib + t * sit + g * sig + s, mask=row_ok & (s < n), other=-1)
            dq += load_tile(PARTS, (part0 + s * h) * DK, dk, row_ok & (j >= 0), DK).to(tl.float32)
    elif SEL == 3:
        dq += load_tile(DQ_SEL, b * sdsb + t * sdst + head * sdsh, dk, row_ok, DK)
    store_tile(DQ, b * sdqb + t * sdqt + head * sdqh, dk, row_ok, dq, DK)


def _groups(cmp: tuple | None, win: tuple | None, sel: SelectedDQ) -> int:
    """G, from whichever branch's keys (or the selection) are given."""
    for keys in (cmp and cmp[0], win and win[0], sel.k, sel.choice):
        if keys is not None:
            return keys.shape[2]
    raise ValueError("query_grad needs at least one branch")


def _strides3(t: torch.Tensor | None) -> tuple:
    return tuple(t.stride()[:3]) if t is not None else (0, 0, 0)


def query_grad(q: torch.Tensor, do: torch.Tensor, lse_g: torch.Tensor, delta: torch.Tensor, scale: float,
               block_len: int, block_stride: int, window: int, cmp: tuple | None, win: tuple | None,
               sel: SelectedDQ) -> torch.Tensor:
    """dQ [B,T,H,Dk] in q's dtype: the compressed ((k, v) or None), window ((k, v) or None) and selected branches.

    lse_g and delta [3,B,T,H] (cmp, sel, win) are gating.gate_grads's gated lse and dL/dg.
    """
    B, T, H, Dk = q.shape
    Dv = do.shape[-1]
    G = _groups(cmp, win, sel)
    h = H // G
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    n = sel.choice.shape[-1] if sel.kind == SEL_PARTS else 1
    sel_kv = (sel.k, sel.v) if sel.kind == SEL_TILED else None
    if hopper_query_grad_supports(q, do, cmp, win, sel.kind, sel_kv, sel.sel_block):
        query_grad_hopper(q, do, dq, lse_g, delta, scale, block_len, block_stride, window, cmp, win, sel.kind, sel_kv,
                          sel.choice, sel.parts, sel.dq, n, sel.sel_block)
        return dq
    # The Triton kernel takes every pointer: absent branches get q as a placeholder.
    kc, vc = cmp if cmp is not None else (q, q)
    kw, vw = win if win is not None else (q, q)
    ks, vs = sel_kv if sel_kv is not None else (q, q)
    choice = sel.choice if sel.choice is not None else q
    cfg = _blocks(q, Dk, Dv, "dq")
    if sel.kind == SEL_TILED and q.device.type == "cuda" and max(Dk, Dv) <= 64:
        cfg["BLOCK_N"] = TUNING.dq_block_n_tiled
    _query_grad_kernel[(triton.cdiv(T * h, cfg["BLOCK_M"]), B * G)](
        q, do, dq, lse_g[0], delta[0], lse_g[1], delta[1], lse_g[2], delta[2], kc, vc, ks, vs, kw, vw, choice,
        sel.parts if sel.parts is not None else q, sel.dq if sel.dq is not None else q,
        *q.stride()[:3], *do.stride()[:3], *lse_g.stride()[1:3], *dq.stride()[:3],
        *_strides3(kc), *_strides3(vc), *_strides3(ks), *_strides3(vs), *_strides3(kw), *_strides3(vw),
        *_strides3(choice if sel.choice is not None else None), *_strides3(sel.dq),
        T, kc.shape[1] if cmp is not None else 0, G, h, n, scale * LOG2E, scale, block_len, block_stride, window,
        sel.sel_block, HAS_CMP=cmp is not None, HAS_WIN=win is not None, SEL=sel.kind,
        NP=triton.next_power_of_2(n), ONE_BLOCK=sel.sel_block % cfg["BLOCK_N"] == 0, **head_dims(Dk, Dv), **cfg,
    )
    return dq

