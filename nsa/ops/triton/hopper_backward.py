"""range_attention's dK/dV kernel for Hopper GPUs, written in Gluon (see hopper_forward.py for why Gluon).

Same contract as range_attention_dkdv for the compressed, window and tiled selected branches: one program per
tile of keys (and split of the rows that see it), looping over the (token, head) rows of the key/value group
that see the tile. On an H100 at M7C's shape, Triton's kernel sits at 255 registers with spills and keeps the
tensor cores 30-37% busy, cuDNN's backward ~43% (docs/experiments.md). Here:

- the key and value tiles arrive once by TMA; each row step's queries and output gradients are copied into a
  ring of shared-memory stages by cp.async (a row step starts mid-token when h is not a power of two, which a
  TMA box cannot), the copies of later steps in flight while the current one computes;
- S^T = K Q^T and dP^T = V dO^T are issued together as asynchronous wgmma; P^T = exp2(S^T - lse) is computed
  while dP^T is still running, dV += P^T dO is issued before dS^T = P^T (dP^T - delta) is formed, and
  dK += dS^T Q after it;
- the tiles' scores stay in registers (wgmma's register A operand), never in shared memory.

Gluon has no CPU interpreter: the Triton kernel stays the one the CPU tests check against the reference, this
one is checked against it on the GPU (tests/test_triton_gpu.py) and compiled for sm_90 in CI
(tests/test_kernel_probes.py). `hopper_backward_supports` says when it applies.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .hopper_forward import _descriptor, gluon_layout_ok
from .tuning import TUNING


@gluon.constexpr_function
def wgmma_layout(num_warps, n):
    """The layout of a wgmma result with n columns. In the transposed dK/dV products keys are its rows (a warp per
    16 keys) and a step's (token, head) rows its columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def row_io_layout(num_warps, d):
    """Row-major [rows, d] tiles in 16-byte pieces: the rows' copies into shared memory and the gradients' stores."""
    return gl.BlockedLayout([1, 8], [32 // (d // 8), d // 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def add_io_layout(num_warps, d):
    """Row-major float32 [rows, d] tiles in 16-byte pieces (four-wide atomic adds): the gradients' adds."""
    return gl.BlockedLayout([1, 4], [32 // (d // 4), d // 4], [num_warps, 1], [1, 0])


@gluon.jit
def _rows_seeing(k_first, NK, T, MODE: gl.constexpr, BLOCK_N: gl.constexpr, block_len, block_stride, window):
    """Tokens that see any key of the tile [t_lo, t_hi] and those that see all of them [f_lo, f_hi]
    (range_attention._range_bwd_dkdv_kernel's bounds)."""
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
    next step they would take ~100 (the products' column layout replicates them across a warp's lanes)."""
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
    """[keys, rows]: whether query token t sees key `key` (range_attention._sees), false outside both ranges."""
    if MODE == 0:
        first = gl.where(key < NK, key * block_stride + block_len - 1, 2147483647)  # the first query that sees it
        return first[:, None] <= gl.where(row_ok, t, -1)[None, :]
    elif MODE == 1:  # 0 <= t - key < window, unsigned
        return (gl.where(row_ok, t, -1073741824)[None, :] - key[:, None]).to(gl.uint32) < window.to(gl.uint32)
    else:
        return key[:, None] <= gl.where(row_ok, t, -1)[None, :]


@gluon.jit
def _store_grad(OUT, acc, b, g, key0, NK, sb, st, sg, D: gl.constexpr, BLOCK_N: gl.constexpr,
                ATOMIC: gl.constexpr, num_warps: gl.constexpr):
    """dK or dV of the tile: stored in OUT's type, or added (float32) with relaxed atomics where several splits
    share keys."""
    out_l: gl.constexpr = add_io_layout(num_warps, D)
    acc = gl.convert_layout(acc, out_l)
    key = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, out_l))
    ptr = OUT + (b * sb + g * sg + key.to(gl.int64)[:, None] * st + d[None, :])
    ok = (key < NK)[:, None]
    if ATOMIC:
        gl.atomic_add(ptr, acc, mask=ok, sem="relaxed")
    else:
        gl.store(ptr, acc.to(OUT.dtype.element_ty), mask=ok)


@gluon.jit
def _range_dkdv_hopper(
    Q, DO, k_desc, v_desc, LSE, DELTA, DKo, DVo, BITS,
    sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdkb, sdkt, sdkg, sdvb, sdvt, sdvg, sdks, sdvs, sbb, sbt, sbg,
    T, NK, G, scale_log2, scale, block_len, block_stride, window, sel_block, rows_per_split,
    h: gl.constexpr, MODE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, ATOMIC: gl.constexpr, num_warps: gl.constexpr,
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

    key = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
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
            _store_grad(DKo, dk_acc * scale, b, g, k_first, NK, sdkb, sdkt, sdkg, D, BLOCK_N, True, num_warps)
            _store_grad(DVo, dv_acc, b, g, k_first, NK, sdvb, sdvt, sdvg, D, BLOCK_N, True, num_warps)
    else:
        _store_grad(DKo, dk_acc * scale, b, g, k_first, NK, sdkb, sdkt, sdkg, D, BLOCK_N, False, num_warps)
        _store_grad(DVo, dv_acc, b, g, k_first, NK, sdvb, sdvt, sdvg, D, BLOCK_N, False, num_warps)


def hopper_backward_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, mode: int,
                             sel_block: int) -> bool:
    """Whether the Gluon dK/dV kernel serves this call: hopper_forward's conditions (sm_90, bf16, Dk == Dv in
    {64, 128}, keys and values as TMA tiles), do's rows 16-byte aligned, and for the selected branch whole blocks
    per key tile."""
    if not (TUNING.hopper_backward and gluon_layout_ok(q, k, v)):
        return False
    # 16-byte copies of the rows: the kernel compiles them only with every q/do stride a multiple of 16 elements
    # (Triton's launch specialisation), which contiguous [B,T,H,64|128] tensors have.
    if do.dtype != q.dtype or do.shape != q.shape[:3] + (v.shape[-1],):
        return False
    if any(x.stride(-1) != 1 or x.data_ptr() % 16 or any(s % 16 for s in x.stride()[:3]) for x in (q, do)):
        return False
    return mode != 2 or sel_block % hopper_backward_config(q.shape[-1])["BLOCK_N"] == 0


def hopper_backward_config(d: int) -> dict:
    """Rows per step, keys per program (a warp per 16 keys), stages of the rows' ring."""
    if d <= 64:
        keys = TUNING.hopper_dkdv_block_n
        return dict(BLOCK_M=TUNING.hopper_dkdv_block_m, BLOCK_N=keys, STAGES=TUNING.hopper_dkdv_stages,
                    num_warps=keys // 16)
    # Compiled for sm_90: 32 rows need 224 registers; 64 rows x 128 keys spill.
    return dict(BLOCK_M=32, BLOCK_N=64, STAGES=2, num_warps=4)


def range_attention_dkdv_hopper(q, k, v, do, lse, delta, dk_out, dv_out, mode: int, scale: float, block_len: int,
                                block_stride: int, window: int, bits, bit_strides: tuple, sel_block: int,
                                splits: int, rows_per_split: int) -> None:
    """range_attention_dkdv's kernel on Hopper. dk_out and dv_out are [parts, *k.shape]: with one part, splits > 1
    add into it (float32, zeroed) and a single split writes it; with `splits` parts, each split writes its own."""
    B, T, H, D = q.shape
    NK, G = k.shape[1], k.shape[2]
    cfg = hopper_backward_config(D)
    grid = (-(-NK // cfg["BLOCK_N"]), splits, B * G)
    parts = dk_out.shape[0]
    _range_dkdv_hopper[grid](
        q, do, _descriptor(k, cfg["BLOCK_N"]), _descriptor(v, cfg["BLOCK_N"]), lse, delta, dk_out, dv_out, bits,
        q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
        *dk_out.stride()[1:4], *dv_out.stride()[1:4], *((dk_out.stride(0), dv_out.stride(0)) if parts > 1 else (0, 0)),
        *bit_strides, T, NK, G, scale * 1.4426950408889634, scale, block_len, block_stride, window,
        max(sel_block, 1), rows_per_split, h=H // G, MODE=mode, D=D, ATOMIC=splits > parts, **cfg,
    )
