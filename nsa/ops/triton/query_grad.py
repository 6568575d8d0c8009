"""dQ of all three branches in one pass, written once in q's dtype.

One program per tile of (token, head) rows (the span kernels' layout, common.py). It loads the rows' q and do
once, walks the compressed keys and the window's keys (the span kernels' masked-edge / interior loops, each branch
with its own gated lse and delta), and takes the selected branch's share in whichever form its path left it
(branches.SelectedDQ):

- SEL_TILED (short T): the selected branch's causal tiles masked by the choices, walked here too;
- SEL_PARTS (block-centric path): the sum of the query's per-slot dQ partials;
- SEL_DENSE (per-query path, or the Gluon block-centric backward's adds): a float32 dQ;
- SEL_NONE: no selected branch (a branch timed alone).

Packed documents (a PackedLayout): the span kernels' rules (span_attention.py), behind the same PACKED flag; the
gathered paths' shares are per query and need no layout here.

One pass instead of one per branch: q and do are read once and dQ is written once, where per-branch passes would
read them three times and write, read and convert a float32 dQ in between.

On sm_90 GPUs nsa.ops.dispatch may run the Gluon kernel of nsa.ops.gluon.query_grad instead (same contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..branches import MODE_SEL, SEL_PARTS, SEL_TILED, SelectedDQ
from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..tuning import TUNING
from . import launcher
from .common import (LOG2E, ceil_div, dot_precision, head_dims, key_plan, key_step, load_tile, next_power_of_two,
                     one_block, picked, picked_rows, program_rows, store_tile, tile_sizes, visible)


@triton.jit
def _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, first, last, lo, hi, row_ok, chosen, sel_block,
             doc_key, dk, dv, scale_log2, dq, MASKED: tl.constexpr, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
             PACKED: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """dq plus the (unscaled) dQ over key steps [first, last) of one branch; MASKED applies each row's range.
    PACKED, MODE_SEL: unmasked steps lie in one document, whose first key is doc_key."""
    for start in range(first, last, BLOCK_N):
        kidx, k, v = key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MODE == 2 and ONE_BLOCK:
            p = tl.exp2(s * scale_log2 - tl.where(picked_rows(chosen, start, sel_block), lse2, float("inf"))[:, None])
        else:
            p = tl.exp2(s * scale_log2 - lse2[:, None])
        if MASKED:
            p = tl.where(visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE, ONE_BLOCK, PACKED), p, 0.0)
        elif MODE == 2 and PACKED:
            p = tl.where(picked(chosen, kidx - doc_key, sel_block), p, 0.0)
        elif MODE == 2 and not ONE_BLOCK:
            p = tl.where(picked(chosen, kidx, sel_block), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _branch_dq(q, do, dq, LSE, DELTA, lse_off, row_ok, K, V, k_base, v_base, skt, svt, NK, pid_m, b, g, t, T,
               h: tl.constexpr, IDX, sib, sit, sig, block_len, block_stride, window, sel_block, dk, dv, scale_log2,
               DOC_START, CMP_START, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr, PACKED: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """dq plus one range branch's (unscaled) dQ for the program's rows."""
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    lo, hi, k_start, k_end, chosen, a, e, doc_key = key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE,
                                                              block_len, block_stride, window, BLOCK_M, BLOCK_N,
                                                              PACKED, DOC_START, CMP_START)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, k_start, a, lo, hi, row_ok, chosen,
                  sel_block, doc_key, dk, dv, scale_log2, dq, True, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_N,
                  DOT_PRECISION)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, a, e, lo, hi, row_ok, chosen,
                  sel_block, doc_key, dk, dv, scale_log2, dq, False, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_N,
                  DOT_PRECISION)
    dq = _dq_keys(q, do, lse2, delta, K, V, k_base, v_base, skt, svt, NK, e, k_end, lo, hi, row_ok, chosen,
                  sel_block, doc_key, dk, dv, scale_log2, dq, True, MODE, ONE_BLOCK, PACKED, DK, DV, BLOCK_N,
                  DOT_PRECISION)
    return dq


@triton.jit
def _query_grad_kernel(
    Q, DO, DQ, LSE_C, DELTA_C, LSE_S, DELTA_S, LSE_W, DELTA_W, KC, VC, KS, VS, KW, VW, SEL_IDX, PARTS, DQ_SEL,
    DOC_START, CMP_START,
    sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdqb, sdqt, sdqh,
    skcb, skct, skcg, svcb, svct, svcg, sksb, skst, sksg, svsb, svst, svsg, skwb, skwt, skwg, svwb, svwt, svwg,
    sib, sit, sig, sdsb, sdst, sdsh,
    T, NC, G, h: tl.constexpr, n, scale_log2, scale, block_len, block_stride, window, sel_block,
    HAS_CMP: tl.constexpr, HAS_WIN: tl.constexpr, SEL: tl.constexpr, NP: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, PACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b, g, row_ok, t, head = program_rows(pid_m, tl.program_id(1), T, G, h, BLOCK_M)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q, b * sqb + t * sqt + head * sqh, dk, row_ok, DK)
    do = load_tile(DO, b * sdob + t * sdot + head * sdoh, dv, row_ok, DV)
    lse_off = b * slb + t * slt + head
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    # The branches' modes are branches.MODE_CMP (0), MODE_WIN (1) and MODE_SEL (2); SEL is a SEL_* kind.
    if HAS_CMP:
        dq = _branch_dq(q, do, dq, LSE_C, DELTA_C, lse_off, row_ok, KC, VC, b * skcb + g * skcg, b * svcb + g * svcg,
                        skct, svct, NC, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, DOC_START, CMP_START, 0, ONE_BLOCK, PACKED,
                        DK, DV, BLOCK_M, BLOCK_N, DOT_PRECISION)
    if HAS_WIN:
        dq = _branch_dq(q, do, dq, LSE_W, DELTA_W, lse_off, row_ok, KW, VW, b * skwb + g * skwg, b * svwb + g * svwg,
                        skwt, svwt, T, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, DOC_START, CMP_START, 1, ONE_BLOCK, PACKED,
                        DK, DV, BLOCK_M, BLOCK_N, DOT_PRECISION)
    if SEL == 1:
        dq = _branch_dq(q, do, dq, LSE_S, DELTA_S, lse_off, row_ok, KS, VS, b * sksb + g * sksg, b * svsb + g * svsg,
                        skst, svst, T, pid_m, b, g, t, T, h, SEL_IDX, sib, sit, sig, block_len, block_stride,
                        window, sel_block, dk, dv, scale_log2, DOC_START, CMP_START, 2, ONE_BLOCK, PACKED,
                        DK, DV, BLOCK_M, BLOCK_N, DOT_PRECISION)
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


def launch(q: torch.Tensor, do: torch.Tensor, dq: torch.Tensor, lse_g: torch.Tensor, delta: torch.Tensor,
           scale: float, geometry: NSAGeometry, cmp: tuple | None, win: tuple | None, sel: SelectedDQ,
           layout: PackedLayout | None = None) -> None:
    """dQ [B,T,H,Dk] into dq (q's dtype) from the compressed ((k, v) or None), window ((k, v) or None) and selected
    branches; lse_g and delta [3,B,T,H] (cmp, sel, win) are gating.gate_grads's gated lse and dL/dg. With a layout,
    one packed stream of documents (span_attention.forward's rules)."""
    B, T, H, Dk = q.shape
    Dv = do.shape[-1]
    G = _groups(cmp, win, sel)
    h = H // G
    n = sel.choice.shape[-1] if sel.kind == SEL_PARTS else 1
    # The kernel takes every pointer: absent branches get q as a placeholder.
    kc, vc = cmp if cmp is not None else (q, q)
    kw, vw = win if win is not None else (q, q)
    ks, vs = (sel.k, sel.v) if sel.kind == SEL_TILED else (q, q)
    choice = sel.choice if sel.choice is not None else q
    cfg = tile_sizes(q, Dk, Dv, "dq")
    if sel.kind == SEL_TILED and q.device.type == "cuda" and max(Dk, Dv) <= 64:
        cfg["BLOCK_N"] = TUNING.dq_block_n_tiled
    launcher.launch(_query_grad_kernel, (ceil_div(T * h, cfg["BLOCK_M"]), B * G),
        q, do, dq, lse_g[0], delta[0], lse_g[1], delta[1], lse_g[2], delta[2], kc, vc, ks, vs, kw, vw, choice,
        sel.parts if sel.parts is not None else q, sel.dq if sel.dq is not None else q,
        *((layout.doc_start, layout.cmp_start) if layout is not None else (None, None)),
        *q.stride()[:3], *do.stride()[:3], *lse_g.stride()[1:3], *dq.stride()[:3],
        *_strides3(kc), *_strides3(vc), *_strides3(ks), *_strides3(vs), *_strides3(kw), *_strides3(vw),
        *_strides3(sel.choice), *_strides3(sel.dq),
        T, kc.shape[1] if cmp is not None else 0, G, h, n, scale * LOG2E, scale, geometry.block_len,
        geometry.block_stride, geometry.window, geometry.sel_block, HAS_CMP=cmp is not None, HAS_WIN=win is not None,
        SEL=sel.kind, NP=next_power_of_two(n),
        ONE_BLOCK=one_block(MODE_SEL, geometry.sel_block, cfg["BLOCK_N"], layout), PACKED=layout is not None,
        DOT_PRECISION=dot_precision(q.dtype), **head_dims(Dk, Dv), **cfg,
    )
