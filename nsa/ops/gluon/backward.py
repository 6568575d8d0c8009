"""The span dK/dV kernel (compressed, window and tiled selected branches) for Hopper GPUs, written in Gluon.

Same contract as nsa.ops.triton.span_attention.dkdv: one program per tile of keys (and split of the rows that see
it), looping over the (token, head) rows of the key/value group that see the tile. Triton's kernel spills at head
dim 64 and leaves the tensor cores idle much of the time. Here:

- the key and value tiles arrive once by TMA; each row step's queries and output gradients are copied into a
  ring of shared-memory stages by cp.async (a row step starts mid-token when h is not a power of two, which a
  TMA box cannot), the copies of later steps in flight while the current one computes;
- S^T = K Q^T and dP^T = V dO^T are issued together as asynchronous wgmma; P^T = exp2(S^T - lse) is computed
  while dP^T is still running, dV += P^T dO is issued before dS^T = P^T (dP^T - delta) is formed, and
  dK += dS^T Q after it;
- the tiles' scores stay in registers (wgmma's register A operand), never in shared memory.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..tuning import TUNING
from .common import (descriptor, document_key_queries, layout_ok, row_io_layout, rows_copyable, store_grad,
                     wgmma_layout)


@gluon.jit
def _rows_seeing(k_first, NK, T, MODE: gl.constexpr, BLOCK_N: gl.constexpr, block_len, block_stride, window):
    """Tokens that see any key of the tile [t_lo, t_hi] and those that see all of them [f_lo, f_hi] (the Triton
    span dK/dV kernel's bounds)."""
    k_last = gl.minimum(NK - 1, k_first + BLOCK_N - 1)
    if MODE == 0:
        t_lo = k_first * block_stride + block_len - 1
        t_hi = T - 1
        f_lo = (k_first + BLOCK_N - 1) * block_stride + block_len - 1
        f_hi = T - 1
    elif MODE == 1:
        t_lo = k_first
        t_hi = gl.minimum(T - 1, k_last + window - 1)
        f_lo = k_first + BLOCK_N - 1
        f_hi = k_first + window - 1
    else:
        t_lo = k_first
        t_hi = T - 1
        f_lo = k_first + BLOCK_N - 1
        f_hi = T - 1
    return t_lo, t_hi, f_lo, f_hi


@gluon.jit
def _load_rows(Q, DO, q_smem, do_smem, stage, r0, split_hi, b, g, sqb, sqt, sqh, sdob, sdot, sdoh,
               h: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, io: gl.constexpr):
    """cp.async of rows [r0, r0 + BLOCK_M) (rows from split_hi on read 0) of q and do into a ring stage."""
    r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    ok = (r < split_hi)[:, None]
    tok = (r // h).to(gl.int64)[:, None]
    hd = (g * h + r % h).to(gl.int64)[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, io))[None, :]
    async_copy.async_copy_global_to_shared(q_smem.index(stage), Q + (b * sqb + tok * sqt + hd * sqh + d), mask=ok)
    async_copy.async_copy_global_to_shared(do_smem.index(stage), DO + (b * sdob + tok * sdot + hd * sdoh + d),
                                           mask=ok)


@gluon.jit
def _load_stats(LSE, DELTA, BITS, lse_smem, delta_smem, bits_smem, stage, r0, split_hi, b, g, slb, slt, sbb, sbt,
                sbg, h: gl.constexpr, MODE: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """cp.async of a row step's log-sum-exp, delta (and chosen bits) into a ring stage: held in registers for the
    next step they would take many (the products' column layout replicates them across a warp's lanes)."""
    r = r0 + gl.arange(0, BLOCK_M, layout=layout)
    ok = r < split_hi
    t = (r // h).to(gl.int64)
    off = b * slb + t * slt + g * h + r % h
    async_copy.async_copy_global_to_shared(lse_smem.index(stage), LSE + off, mask=ok)
    async_copy.async_copy_global_to_shared(delta_smem.index(stage), DELTA + off, mask=ok)
    if MODE == 2:
        async_copy.async_copy_global_to_shared(bits_smem.index(stage), BITS + (b * sbb + t * sbt + g * sbg), mask=ok)


@gluon.jit
def _step_stats(lse_smem, delta_smem, bits_smem, stage, k_first, sel_block, MODE: gl.constexpr, layout: gl.constexpr):
    """(lse in log2 units, delta) of a row step from its ring stage; for the selected branch rows that did not
    choose the tile's block get lse = +inf (p = 0: a key tile lies in one block)."""
    lse2 = lse_smem.index(stage).load(layout) * 1.4426950408889634
    delta = delta_smem.index(stage).load(layout)
    if MODE == 2:
        bits = bits_smem.index(stage).load(layout)
        lse2 = gl.where(((bits >> (k_first // sel_block)) & 1) != 0, lse2, float("inf"))
    return lse2, delta


@gluon.jit
def _sees(key, t, row_ok, MODE: gl.constexpr, NK, block_len, block_stride, window):
    """[keys, rows]: whether query token t sees key `key` (as in the Triton span dK/dV kernel), false outside both
    ranges."""
    if MODE == 0:
        first = gl.where(key < NK, key * block_stride + block_len - 1, 2147483647)  # the first query that sees it
        return first[:, None] <= gl.where(row_ok, t, -1)[None, :]
    elif MODE == 1:  # 0 <= t - key < window, unsigned
        return (gl.where(row_ok, t, -1073741824)[None, :] - key[:, None]).to(gl.uint32) < window.to(gl.uint32)
    else:
        return key[:, None] <= gl.where(row_ok, t, -1)[None, :]


@gluon.jit
def _span_dkdv_kernel(
    Q, DO, k_desc, v_desc, LSE, DELTA, DKo, DVo, BITS, DOC_END, CMP_READY, CMP_DOC_END,
    sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdkb, sdkt, sdkg, sdvb, sdvt, sdvg, sdks, sdvs, sbb, sbt, sbg,
    T, NK, G, scale_log2, scale, block_len, block_stride, window, sel_block, rows_per_split,
    h: gl.constexpr, MODE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, ATOMIC: gl.constexpr, num_warps: gl.constexpr, PACKED: gl.constexpr = False,
):
    pid_n = gl.program_id(0)
    pid_split = gl.program_id(1)
    pid_bg = gl.program_id(2)
    # Each split's own slice of the outputs in deterministic mode (sdks, sdvs), else 0.
    DKo = DKo + pid_split.to(gl.int64) * sdks
    DVo = DVo + pid_split.to(gl.int64) * sdvs
    b32 = pid_bg // G  # TMA coordinates are 32-bit; pointer offsets use b, 64-bit
    b = b32.to(gl.int64)
    g = pid_bg % G
    dtype: gl.constexpr = k_desc.dtype

    st_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(num_warps, D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    io: gl.constexpr = row_io_layout(num_warps, D)
    col: gl.constexpr = gl.SliceLayout(0, st_layout)
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

    k_first = pid_n * BLOCK_N
    key = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    if PACKED:
        # One stream of documents (B = 1; MODE_CMP or MODE_WIN): from each key's own range of queries. A tile of
        # keys of two documents has no row that sees all of them (f_lo > f_hi).
        q_first, q_last = document_key_queries(key, NK, T, DOC_END, CMP_READY, CMP_DOC_END, MODE, window)
        t_lo = gl.min(q_first, 0)
        t_hi = gl.max(q_last, 0)
        f_lo = gl.max(gl.where(key < NK, q_first, -1), 0)
        f_hi = gl.min(gl.where(key < NK, q_last, T), 0)
    else:
        t_lo, t_hi, f_lo, f_hi = _rows_seeing(k_first, NK, T, MODE, BLOCK_N, block_len, block_stride, window)
    # This program covers rows [split_lo, split_hi) of the (token, head) rows that see the tile, in steps from
    # row_start; the steps inside [a, e) see every key of the tile (no range mask).
    split_lo = pid_split * rows_per_split
    split_hi = gl.minimum((t_hi + 1) * h, split_lo + rows_per_split)
    row_start = gl.maximum(split_lo, ((t_lo * h) // BLOCK_M) * BLOCK_M)
    last = gl.maximum(split_hi, row_start)
    a = gl.minimum(gl.maximum(gl.cdiv(f_lo * h, BLOCK_M) * BLOCK_M, row_start), last)
    e = gl.maximum(gl.minimum((((f_hi + 1) * h) // BLOCK_M) * BLOCK_M, (last // BLOCK_M) * BLOCK_M), a)
    n_steps = gl.cdiv(last - row_start, BLOCK_M)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
    row_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], row_smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], row_smem)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], flat)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], flat)
    bits_smem = gl.allocate_shared_memory(gl.int64, [STAGES if MODE == 2 else 1, BLOCK_M], flat)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b32 * NK + k_first, g * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b32 * NK + k_first, g * D], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        if i < n_steps:
            _load_rows(Q, DO, q_smem, do_smem, i, row_start + i * BLOCK_M, split_hi, b, g, sqb, sqt, sqh,
                       sdob, sdot, sdoh, h, D, BLOCK_M, io)
            _load_stats(LSE, DELTA, BITS, lse_smem, delta_smem, bits_smem, i, row_start + i * BLOCK_M, split_hi, b,
                        g, slb, slt, sbb, sbt, sbg, h, MODE, BLOCK_M, vec)
        async_copy.commit_group()  # one group per step, empty or not, so wait_group counts steps

    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dk_acc = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
    dv_acc = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(n_steps):
        r0 = row_start + j * BLOCK_M
        stage = j % STAGES
        # Step j's copies are done (this thread's, then everyone's), and visible to the tensor cores' proxy.
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        # Step j + STAGES - 1 goes into step j - 1's stage: its products were awaited before this barrier.
        if j + STAGES - 1 < n_steps:
            nxt = (j + STAGES - 1) % STAGES
            _load_rows(Q, DO, q_smem, do_smem, nxt, r0 + (STAGES - 1) * BLOCK_M, split_hi, b, g, sqb, sqt, sqh,
                       sdob, sdot, sdoh, h, D, BLOCK_M, io)
            _load_stats(LSE, DELTA, BITS, lse_smem, delta_smem, bits_smem, nxt, r0 + (STAGES - 1) * BLOCK_M,
                        split_hi, b, g, slb, slt, sbb, sbt, sbg, h, MODE, BLOCK_M, vec)
        async_copy.commit_group()
        q_s = q_smem.index(stage)
        do_s = do_smem.index(stage)
        st = warpgroup_mma(k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        lse2, delta = _step_stats(lse_smem, delta_smem, bits_smem, stage, k_first, sel_block, MODE, col)
        st = warpgroup_mma_wait(1, deps=(st,))
        pt = gl.exp2(st * scale_log2 - lse2[None, :])
        if (r0 < a) | (r0 >= e):
            r = r0 + gl.arange(0, BLOCK_M, layout=col)
            if PACKED:
                tt = gl.where(r < split_hi, r // h, -1)[None, :]
                pt = gl.where((q_first[:, None] <= tt) & (tt <= q_last[:, None]), pt, 0.0)
            else:
                pt = gl.where(_sees(key, r // h, r < split_hi, MODE, NK, block_len, block_stride, window), pt, 0.0)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_acc = warpgroup_mma(pt_op, do_s, dv_acc, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        ds_op = gl.convert_layout((pt * (dpt - delta[None, :])).to(dtype), op_layout)
        dk_acc = warpgroup_mma(ds_op, q_s, dk_acc, is_async=True)
        # The register operands must live until their products are done.
        dv_acc, dk_acc, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_acc, dk_acc, pt_op, ds_op))
    async_copy.wait_group(0)
    mbarrier.invalidate(kv_bar)

    if ATOMIC:  # several splits add into the same keys (zero-initialised); a split without rows adds nothing
        if row_start < split_hi:
            store_grad(DKo, dk_acc * scale, b, g, k_first, NK, sdkb, sdkt, sdkg, D, BLOCK_N, True, num_warps)
            store_grad(DVo, dv_acc, b, g, k_first, NK, sdvb, sdvt, sdvg, D, BLOCK_N, True, num_warps)
    else:
        store_grad(DKo, dk_acc * scale, b, g, k_first, NK, sdkb, sdkt, sdkg, D, BLOCK_N, False, num_warps)
        store_grad(DVo, dv_acc, b, g, k_first, NK, sdvb, sdvt, sdvg, D, BLOCK_N, False, num_warps)


def config(d: int) -> dict:
    """Rows per step, keys per program (a warp per 16 keys), stages of the rows' ring."""
    if d <= 64:
        keys = TUNING.gluon_dkdv_block_n
        return dict(BLOCK_M=TUNING.gluon_dkdv_block_m, BLOCK_N=keys, STAGES=TUNING.gluon_dkdv_stages,
                    num_warps=keys // 16)
    # Compiled for sm_90: 32 rows fit the registers; 64 rows x 128 keys spill.
    return dict(BLOCK_M=32, BLOCK_N=64, STAGES=2, num_warps=4)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, mode: int, sel_block: int,
             layout: PackedLayout | None = None) -> bool:
    """Whether this kernel can take the call: common.layout_ok, q's and do's rows copyable in 16-byte pieces
    (common.rows_copyable), and for the selected branch whole blocks per key tile; packed documents (`layout`)
    for the compressed and window branches (the tiled selected branch's tiles do not align with a document's
    blocks: Triton's kernel takes it)."""
    if layout is not None and mode == 2:
        return False
    if not layout_ok(q, k, v) or do.dtype != q.dtype or do.shape != q.shape[:3] + (v.shape[-1],):
        return False
    return rows_copyable(q, do) and (mode != 2 or sel_block % config(q.shape[-1])["BLOCK_N"] == 0)


def launch(q, k, v, do, lse, delta, dk_out, dv_out, mode: int, scale: float, geometry: NSAGeometry, bits,
           bit_strides: tuple, splits: int, rows_per_split: int, layout: PackedLayout | None = None) -> None:
    """The span dK/dV (tiles: config). dk_out and dv_out are [parts, *k.shape]: with one part, splits > 1 add into
    it (float32, zeroed) and a single split writes it; with `splits` parts, each split writes its own. With
    `layout`, one packed stream of documents."""
    B, T, H, D = q.shape
    NK, G = k.shape[1], k.shape[2]
    cfg = config(D)
    grid = (-(-NK // cfg["BLOCK_N"]), splits, B * G)
    parts = dk_out.shape[0]
    _span_dkdv_kernel[grid](
        q, do, descriptor(k, cfg["BLOCK_N"]), descriptor(v, cfg["BLOCK_N"]), lse, delta, dk_out, dv_out, bits,
        *((layout.doc_end, layout.cmp_ready, layout.cmp_doc_end) if layout is not None else (None, None, None)),
        q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
        *dk_out.stride()[1:4], *dv_out.stride()[1:4], *((dk_out.stride(0), dv_out.stride(0)) if parts > 1 else (0, 0)),
        *bit_strides, T, NK, G, scale * 1.4426950408889634, scale, geometry.block_len, geometry.block_stride,
        geometry.window, geometry.sel_block, rows_per_split, h=H // G, MODE=mode, D=D, ATOMIC=splits > parts,
        PACKED=layout is not None, **cfg,
    )
