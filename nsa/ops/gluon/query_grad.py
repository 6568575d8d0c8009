"""The dQ kernel of every branch (nsa.ops.triton.query_grad) for Hopper GPUs, written in Gluon.

Same contract as the Triton kernel: one program per tile of (token, head) rows of a key/value group, its q and do
loaded once into shared memory; it walks the compressed keys, the window's keys and (short sequences) the selected
branch's causal tiles masked by the choices, each branch with its own gated lse and delta, then adds the selected
branch's ready-made share (block-centric partials or a float32 dQ) and writes dQ once in q's dtype.

Per key step, S = Q K^T and dP = dO V^T are issued together as asynchronous wgmma on keys and values that arrive
by TMA into a ring of shared-memory stages; P is computed while dP runs, and dQ += dS K is left running while the
next step's products are issued. The branches share the ring: a running step count gives each step its stage and
barrier phase.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from ..branches import SEL_PARTS, SEL_TILED, SelectedDQ
from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..tuning import TUNING
from .common import descriptor, document_key_range, key_range, layout_ok, load_kv


@gluon.jit
def _branch_dq(q_smem, do_smem, k_desc, v_desc, k_smem, v_smem, bars, base, dq, LSE, DELTA, lse_off, t, row_ok,
               BITS, bit_off, b32, g, NK, scale_log2, block_len, block_stride, window, sel_block, DOC_START,
               CMP_START, MODE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr, PACKED: gl.constexpr):
    """dq (float32, unscaled) plus one branch's share for the program's rows; base counts the ring's steps so far
    (returned advanced by this branch's). PACKED: the rows' ranges inside their documents (MODE_CMP, MODE_WIN)."""
    dtype: gl.constexpr = k_desc.dtype
    lse2 = gl.load(LSE + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = gl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    if PACKED:
        lo, hi = document_key_range(t, row_ok, DOC_START, CMP_START, MODE, block_len, block_stride, window)
    else:
        lo, hi = key_range(t, row_ok, MODE, block_len, block_stride, window)
    k_start = (gl.min(gl.where(row_ok, lo, NK), 0) // BLOCK_N) * BLOCK_N
    k_end = gl.max(hi, 0) + 1
    a = gl.max(gl.where(row_ok, lo, 0), 0)  # steps inside [a, e) are seen whole by every row
    e = gl.min(gl.where(row_ok, hi, NK), 0) + 1
    n_tiles = gl.maximum(gl.cdiv(k_end - k_start, BLOCK_N), 0)
    bits = t.to(gl.int64) * 0
    if MODE == 2:
        bits = gl.load(BITS + bit_off, mask=row_ok, other=0)
    row0 = b32 * NK + k_start
    for i in gl.static_range(STAGES - 1):
        if i < n_tiles:
            load_kv(k_desc, v_desc, bars, k_smem, v_smem, base + i, row0 - base * BLOCK_N, g * D, g * D, BLOCK_N,
                     STAGES)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=op_layout)
    dq = warpgroup_mma_init(dq)
    for i in range(n_tiles):
        it = base + i
        stage = it % STAGES
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # S_i done, and the previous step's dQ product before it (in order): its stage is free, and its register
        # operand may go.
        s, ds_op = warpgroup_mma_wait(1, deps=(s, ds_op))
        if i + STAGES - 1 < n_tiles:
            load_kv(k_desc, v_desc, bars, k_smem, v_smem, it + STAGES - 1, row0 - base * BLOCK_N, g * D, g * D,
                     BLOCK_N, STAGES)
        start = k_start + i * BLOCK_N
        lse_i = lse2
        if MODE == 2:  # rows that did not choose this step's block (a step lies in one block): p = 0
            lse_i = gl.where(((bits >> (start // sel_block)) & 1) != 0, lse2, float("inf"))
        p = gl.exp2(s * scale_log2 - lse_i[:, None])
        if (start < a) | (start + BLOCK_N > e):
            key = start + cols
            p = gl.where((key[None, :] >= lo[:, None]) & (key[None, :] <= hi[:, None]), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
        dq = warpgroup_mma(ds_op, k_smem.index(stage), dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
    return dq, base + n_tiles


@gluon.jit
def _query_grad_kernel(
    Q, DO, DQ, LSE_C, DELTA_C, LSE_S, DELTA_S, LSE_W, DELTA_W, kc_desc, vc_desc, ks_desc, vs_desc, kw_desc, vw_desc,
    SEL_IDX, PARTS, DQ_SEL, DOC_START, CMP_START,
    sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdqb, sdqt, sdqh, sib, sit, sig, sdsb, sdst, sdsh,
    T, NC, G, n, scale_log2, scale, block_len, block_stride, window, sel_block,
    h: gl.constexpr, HAS_CMP: gl.constexpr, HAS_WIN: gl.constexpr, SEL: gl.constexpr, NP: gl.constexpr,
    D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    PACKED: gl.constexpr = False,
):
    pid_m = gl.program_id(0)
    pid_bg = gl.program_id(1)
    b32 = pid_bg // G  # TMA coordinates are 32-bit; pointer offsets use b, 64-bit
    b = b32.to(gl.int64)
    g = pid_bg % G
    dtype: gl.constexpr = kw_desc.dtype  # every descriptor's (absent branches get a present one's)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [num_warps, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    row_ok = rows < T * h
    t = rows // h
    lse_off = b * slb + t.to(gl.int64) * slt + g * h + rows % h
    bit_off = b * sib + t.to(gl.int64) * sit + g * sig

    # The rows' q and do: loaded once, by plain 16-byte loads into shared memory (a row step starts mid-token).
    r = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    ok = (r < T * h)[:, None]
    tok = (r // h).to(gl.int64)[:, None]
    hd = (g * h + r % h).to(gl.int64)[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, io))[None, :]
    row_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], row_smem,
                                       gl.load(Q + (b * sqb + tok * sqt + hd * sqh + d), mask=ok, other=0.0))
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], row_smem,
                                        gl.load(DO + (b * sdob + tok * sdot + hd * sdoh + d), mask=ok, other=0.0))
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kw_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], vw_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # q, do and the barriers before the tensor cores and TMA see them

    dq = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
    base = pid_m * 0
    # The branches' modes are branches.MODE_CMP (0), MODE_WIN (1) and MODE_SEL (2); SEL is a SEL_* kind.
    if HAS_CMP:
        dq, base = _branch_dq(q_smem, do_smem, kc_desc, vc_desc, k_smem, v_smem, bars, base, dq, LSE_C, DELTA_C,
                              lse_off, t, row_ok, SEL_IDX, bit_off, b32, g, NC, scale_log2, block_len, block_stride,
                              window, sel_block, DOC_START, CMP_START, 0, D, BLOCK_M, BLOCK_N, STAGES, s_layout,
                              op_layout, PACKED)
    if HAS_WIN:
        dq, base = _branch_dq(q_smem, do_smem, kw_desc, vw_desc, k_smem, v_smem, bars, base, dq, LSE_W, DELTA_W,
                              lse_off, t, row_ok, SEL_IDX, bit_off, b32, g, T, scale_log2, block_len, block_stride,
                              window, sel_block, DOC_START, CMP_START, 1, D, BLOCK_M, BLOCK_N, STAGES, s_layout,
                              op_layout, PACKED)
    if SEL == 1:
        dq, base = _branch_dq(q_smem, do_smem, ks_desc, vs_desc, k_smem, v_smem, bars, base, dq, LSE_S, DELTA_S,
                              lse_off, t, row_ok, SEL_IDX, bit_off, b32, g, T, scale_log2, block_len, block_stride,
                              window, sel_block, DOC_START, CMP_START, 2, D, BLOCK_M, BLOCK_N, STAGES, s_layout,
                              op_layout, False)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # The selected branch's ready-made share and the store, in a row-major layout (16-byte accesses).
    dq = gl.convert_layout(dq * scale, io)
    if SEL == 2:
        part0 = ((((b * G + g) * T + tok) * n) * h + (hd - g * h)) * D  # slot j of the row: part0 + j * h * D
        for j in gl.static_range(NP):  # unrolled, so the slots' reads do not wait on each other
            idx = gl.load(SEL_IDX + (b * sib + tok * sit + g * sig + j), mask=ok & (j < n), other=-1)
            dq += gl.load(PARTS + (part0 + j * h * D + d), mask=ok & (idx >= 0), other=0.0).to(gl.float32)
    elif SEL == 3:
        dq += gl.load(DQ_SEL + (b * sdsb + tok * sdst + hd * sdsh + d), mask=ok, other=0.0)
    gl.store(DQ + (b * sdqb + tok * sdqt + hd * sdqh + d), dq.to(DQ.dtype.element_ty), mask=ok)


def config(d: int) -> dict:
    """Rows per program (a warp per 16), keys per step, stages of the key/value ring."""
    if d <= 64:
        return dict(BLOCK_M=TUNING.gluon_dq_block_m, BLOCK_N=64, STAGES=TUNING.gluon_dq_stages,
                    num_warps=TUNING.gluon_dq_block_m // 16)
    return dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4)


def supports(q: torch.Tensor, do: torch.Tensor, cmp: tuple | None, win: tuple | None, sel: SelectedDQ,
             sel_block: int, layout: PackedLayout | None = None) -> bool:
    """Whether this kernel can take the call: every branch's keys and values as common.layout_ok takes them, do
    like q, at least one span branch, block-centric partials only at head dims up to 64 (their sum beside a
    128-wide dQ spills on sm_90), and for the tiled selected branch whole blocks per key step; with packed
    documents (`layout`) not the tiled selected branch (its steps do not align with a document's blocks)."""
    if layout is not None and sel.kind == SEL_TILED:
        return False
    if not (do.dtype == q.dtype and do.shape == q.shape and do.stride(-1) == 1) or (win is None and cmp is None):
        return False
    if sel.kind == SEL_PARTS and q.shape[-1] > 64:
        return False
    kvs = [x for x in (cmp, win, (sel.k, sel.v) if sel.kind == SEL_TILED else None) if x is not None]
    if not all(layout_ok(q, k, v) for k, v in kvs):
        return False
    return sel.kind != SEL_TILED or sel_block % config(q.shape[-1])["BLOCK_N"] == 0


def launch(q, do, dq, lse_g, delta, scale: float, geometry: NSAGeometry, cmp: tuple | None, win: tuple | None,
           sel: SelectedDQ, layout: PackedLayout | None = None) -> None:
    """dQ into dq (arguments as nsa.ops.triton.query_grad.launch's; `layout`: one packed stream of documents)."""
    B, T, H, D = q.shape
    cfg = config(D)
    sel_kv = (sel.k, sel.v) if sel.kind == SEL_TILED else None
    present = next(x for x in (win, cmp, sel_kv) if x is not None)
    kc, vc = cmp if cmp is not None else present
    kw, vw = win if win is not None else present
    ks, vs = sel_kv if sel_kv is not None else present
    G = kw.shape[2]
    h = H // G
    n = sel.choice.shape[-1] if sel.kind == SEL_PARTS else 1
    desc = [descriptor(x, cfg["BLOCK_N"]) for x in (kc, vc, ks, vs, kw, vw)]
    strides3 = lambda x: tuple(x.stride()[:3]) if x is not None else (0, 0, 0)  # noqa: E731
    _query_grad_kernel[(-(-T * h // cfg["BLOCK_M"]), B * G)](
        q, do, dq, lse_g[0], delta[0], lse_g[1], delta[1], lse_g[2], delta[2], *desc,
        sel.choice if sel.choice is not None else q, sel.parts if sel.parts is not None else q,
        sel.dq if sel.dq is not None else q,
        *((layout.doc_start, layout.cmp_start) if layout is not None else (None, None)),
        *q.stride()[:3], *do.stride()[:3], *lse_g.stride()[1:3], *dq.stride()[:3], *strides3(sel.choice),
        *strides3(sel.dq), T, kc.shape[1] if cmp is not None else 0, G, n, scale * 1.4426950408889634, scale,
        geometry.block_len, geometry.block_stride, geometry.window, geometry.sel_block, h=h,
        HAS_CMP=cmp is not None, HAS_WIN=win is not None, SEL=sel.kind, NP=max(1, 1 << (n - 1).bit_length()), D=D,
        PACKED=layout is not None, **cfg,
    )
