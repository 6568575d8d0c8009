"""The block-centric selected backward (nsa.ops.triton.selected_attention.block_backward) for Hopper GPUs, in Gluon.

Same contract as the Triton kernel: one program per work item of the inverse index (one key block and at most
`Tuning.inverse_chunk` of the queries that chose it), accumulating the block's dK/dV over the item's
(query, head) rows and adding them atomically; with WRITE_DQ it also writes each row's dQ share to the
per-slot buffer the dQ kernel sums, or with DQ_ADD adds it into a float32 dQ [B,T,H,D] (relaxed atomics: the items
of one query range run together, so the rows they add to stay in the L2 cache). The schedule is backward.py's,
with gathered rows:

- the block's keys and values arrive once by TMA;
- each row step's queries, output gradients, lse, delta and entries are copied into a ring of shared-memory
  stages by cp.async from the addresses the entries give (a TMA box cannot gather), the copies of later steps in
  flight while the current one computes; the next step's entries are read before the ring's wait, so their
  latency hides behind it;
- S^T = K Q^T and dP^T = V dO^T are issued together as asynchronous wgmma, dV += P^T dO before dS^T is formed,
  dK += dS^T Q after it; for dQ, dS^T goes through shared memory into dQ = dS K.

Only the first steps of an item hold queries inside its own block (entries are sorted by query), so only those
steps, and a last partial step, apply a mask. Packed documents: as selected_forward.py's.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..packing import PackedLayout
from ..triton.common import LOG2E
from ..triton.selected_attention import num_block_keys
from . import backward
from .common import (block_first, descriptor, item_block, load_block, masked_rows, ring_turn,
                     row_io_layout, step_entries, store_grad, wgmma_layout)


@gluon.jit
def _load_step(Q, DO, LSE, DELTA, ENTRIES, q_smem, do_smem, lse_smem, delta_smem, ent_smem, stage, f, f_ok, start,
               r0, rows, b, g, bg, T, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, n: gl.constexpr, h: gl.constexpr,
               D: gl.constexpr, BLOCK_M: gl.constexpr, io: gl.constexpr, vec: gl.constexpr):
    """cp.async of a row step into a ring stage: q and do rows at the tokens of entries f (io's row layout), and
    each row's lse, delta and entry (vec layout)."""
    r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    t = (gl.where(f_ok, f // n - bg * T, 0)).to(gl.int64)[:, None]
    hd = (g * h + r % h).to(gl.int64)[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, io))[None, :]
    ok = f_ok[:, None]
    async_copy.async_copy_global_to_shared(q_smem.index(stage), Q + (b * sqb + t * sqt + hd * sqh + d), mask=ok)
    async_copy.async_copy_global_to_shared(do_smem.index(stage), DO + (b * sdob + t * sdot + hd * sdoh + d), mask=ok)
    rv = r0 + gl.arange(0, BLOCK_M, layout=vec)
    ok_v = rv < rows
    async_copy.async_copy_global_to_shared(ent_smem.index(stage), ENTRIES + start + rv // h, mask=ok_v)
    # lse and delta are [B,T,H]: their offsets need the tokens in vec's layout, read again (an L1 hit).
    fv = gl.load(ENTRIES + start + rv // h, mask=ok_v, other=0)
    off = b * slb + gl.where(ok_v, fv // n - bg * T, 0).to(gl.int64) * slt + g * h + rv % h
    async_copy.async_copy_global_to_shared(lse_smem.index(stage), LSE + off, mask=ok_v)
    async_copy.async_copy_global_to_shared(delta_smem.index(stage), DELTA + off, mask=ok_v)


@gluon.constexpr_function
def band_add_layout(num_warps, d):
    """Row-major float32 [rows, d] tiles in 16-byte pieces (four-wide atomic adds) in which each warp holds the
    16-row bands of the wgmma result it computed, so converting dQ to it needs no block-wide barrier (as
    common.add_io_layout's bands across warps would)."""
    col_lanes = min(8, d // 4)
    row_lanes = 32 // col_lanes
    return gl.BlockedLayout([16 // row_lanes, 4], [row_lanes, col_lanes], [num_warps, 1], [1, 0])


@gluon.jit
def _selected_backward_kernel(
    Q, DO, k_desc, v_desc, LSE, DELTA, DKo, DVo, DQPART, ITEM_KEY, ITEM_START, ITEM_COUNT, ENTRIES, BLOCK_START,
    BLOCK_END, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, sdkb, sdkt, sdkg, sdvb, sdvt, sdvg,
    T, G, NS, scale_log2, scale,
    n: gl.constexpr, h: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, WRITE_DQ: gl.constexpr, num_warps: gl.constexpr, PARTIALS: gl.constexpr = False,
    DQ_ADD: gl.constexpr = False, sdqb=0, sdqt=0, sdqh=0, PACKED: gl.constexpr = False,
):
    item = gl.program_id(0)
    count = gl.load(ITEM_COUNT + item)
    if count > 0:
        start, j, bg, b32, b, g = item_block(ITEM_KEY, ITEM_START, item, NS, G)
        dtype: gl.constexpr = k_desc.dtype

        st_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_M)  # keys x rows, as backward.py's
        acc_layout: gl.constexpr = wgmma_layout(num_warps, D)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        io: gl.constexpr = row_io_layout(num_warps, D)
        col: gl.constexpr = gl.SliceLayout(0, st_layout)
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        io_row: gl.constexpr = gl.SliceLayout(1, io)

        k_first = block_first(BLOCK_START, j, BLOCK_N, PACKED)
        # The keys the block holds end at k_end: packed, a document's last block may be short (its keys past k_end,
        # the next document's, get p = 0 from the causal mask and are not written).
        k_end = T
        if PACKED:
            k_end = gl.load(BLOCK_END + j)
        rows = count * h
        n_steps = gl.cdiv(rows, BLOCK_M)
        # The causal mask applies to the rows before `split` and on a last partial step.
        split = masked_rows(ENTRIES, start, count, bg, T, k_first, n, h, BLOCK_N, vec)
        full_end = (rows // BLOCK_M) * BLOCK_M

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
        row_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], row_smem)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], row_smem)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], flat)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], flat)
        ent_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M], flat)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()
        load_block(k_desc, v_desc, kv_bar, k_smem, v_smem, b32 * T + k_first, g * D)
        for i in gl.static_range(STAGES - 1):
            if i < n_steps:
                f_ok, f = step_entries(ENTRIES, start, i * BLOCK_M, rows, h, BLOCK_M, io_row)
                _load_step(Q, DO, LSE, DELTA, ENTRIES, q_smem, do_smem, lse_smem, delta_smem, ent_smem, i, f, f_ok,
                           start, i * BLOCK_M, rows, b, g, bg, T, sqb, sqt, sqh, sdob, sdot, sdoh, slb, slt, n, h, D,
                           BLOCK_M, io, vec)
            async_copy.commit_group()  # one group per step, empty or not, so wait_group counts steps

        key = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
        dk_acc = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
        dv_acc = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
        mbarrier.wait(kv_bar, 0)
        for s in range(n_steps):
            r0 = s * BLOCK_M
            stage = s % STAGES
            nxt_r0, f_ok, f = ring_turn(ENTRIES, start, r0, rows, h, BLOCK_M, STAGES, io_row)
            # Step s + STAGES - 1 goes into step s - 1's stage: its products were awaited before this barrier.
            if s + STAGES - 1 < n_steps:
                _load_step(Q, DO, LSE, DELTA, ENTRIES, q_smem, do_smem, lse_smem, delta_smem, ent_smem,
                           (s + STAGES - 1) % STAGES, f, f_ok, start, nxt_r0, rows, b, g, bg, T, sqb, sqt, sqh,
                           sdob, sdot, sdoh, slb, slt, n, h, D, BLOCK_M, io, vec)
            async_copy.commit_group()
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            st = warpgroup_mma(k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            lse2 = lse_smem.index(stage).load(col) * 1.4426950408889634
            delta = delta_smem.index(stage).load(col)
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = gl.exp2(st * scale_log2 - lse2[None, :])
            if (r0 < split) | (r0 >= full_end):
                r = r0 + gl.arange(0, BLOCK_M, layout=col)
                t = gl.where(r < rows, ent_smem.index(stage).load(col) // n - bg * T, -1)
                pt = gl.where(key[:, None] <= t[None, :], pt, 0.0)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv_acc = warpgroup_mma(pt_op, do_s, dv_acc, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
            ds = (pt * (dpt - delta[None, :])).to(dtype)
            ds_op = gl.convert_layout(ds, op_layout)
            dk_acc = warpgroup_mma(ds_op, q_s, dk_acc, is_async=True)
            if WRITE_DQ:
                # dQ = dS K: dS^T to shared memory, read back transposed as the product's left operand.
                ds_smem.store(ds)
                fence_async_shared()
                gl.thread_barrier()
                dq_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
                dv_acc, dk_acc, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_acc, dk_acc, dq, pt_op, ds_op))
                if DQ_ADD:
                    # A float32 dQ [B,T,H,D] of the branch, added into with relaxed atomics (programs that run
                    # together gather queries of one range when the index is split by query ranges).
                    add_l: gl.constexpr = band_add_layout(num_warps, D)
                    rq = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_l))
                    tq = (ent_smem.index(stage).load(gl.SliceLayout(1, add_l)) // n - bg * T).to(gl.int64)
                    dst = DQPART + (b * sdqb + tq * sdqt + (g * h + rq % h) * sdqh)[:, None] + gl.arange(
                        0, D, layout=gl.SliceLayout(0, add_l))[None, :]
                    gl.atomic_add(dst, gl.convert_layout(dq * scale, add_l), mask=(rq < rows)[:, None],
                                  sem="relaxed")
                else:
                    rq = r0 + gl.arange(0, BLOCK_M, layout=io_row)
                    fq = ent_smem.index(stage).load(io_row).to(gl.int64)
                    dst = DQPART + ((fq * h + rq % h) * D)[:, None] + gl.arange(0, D, layout=gl.SliceLayout(0, io))[
                        None, :]
                    gl.store(dst, gl.convert_layout((dq * scale).to(DQPART.dtype.element_ty), io),
                             mask=(rq < rows)[:, None])
            else:
                # The register operands must live until their products are done.
                dv_acc, dk_acc, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_acc, dk_acc, pt_op, ds_op))
        async_copy.wait_group(0)
        mbarrier.invalidate(kv_bar)
        if PARTIALS:  # deterministic mode: the item's own [BLOCK_N, D] slot (summed by sum_item_partials)
            slot = item.to(gl.int64) * (BLOCK_N * D)
            store_grad(DKo + slot, dk_acc * scale, 0, 0, 0, BLOCK_N, 0, D, 0, D, BLOCK_N, False, num_warps)
            store_grad(DVo + slot, dv_acc, 0, 0, 0, BLOCK_N, 0, D, 0, D, BLOCK_N, False, num_warps)
        else:
            # Blocks chosen by more queries than one item holds have several items: relaxed float32 atomics.
            store_grad(DKo, dk_acc * scale, b, g, k_first, k_end, sdkb, sdkt, sdkg, D, BLOCK_N, True, num_warps)
            store_grad(DVo, dv_acc, b, g, k_first, k_end, sdvb, sdvt, sdvg, D, BLOCK_N, True, num_warps)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, sel_block: int,
             write_dq: bool) -> bool:
    """Whether this kernel can take the call: backward.supports's conditions, a key tile that is exactly one
    selection block, and for dQ shares a head dim of at most 64 (registers)."""
    if not backward.supports(q, k, v, do, 0, sel_block):
        return False
    D = q.shape[-1]
    return sel_block == backward.config(D)["BLOCK_N"] and (D <= 64 or not write_dq)


def launch(q, k, v, do, lse, delta, dk_out, dv_out, dqpart, inverse, scale: float, n: int, write_dq: bool,
           partials: bool = False, dq_add: bool = False, layout: PackedLayout | None = None) -> None:
    """block_backward's work on Hopper (tiles: backward.config): adds the blocks' dK/dV into dk_out/dv_out (float32,
    zeroed), or with `partials` writes each item's to its slot of dk_out/dv_out [items, BLOCK_N, D]; with write_dq,
    writes the rows' dQ shares into dqpart, or with dq_add adds them into dqpart as a float32 [B,T,H,D] dQ
    (zeroed). With `layout`, one packed stream of documents (`inverse` built with it)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    item_key, item_start, item_count, entries = inverse
    cfg = backward.config(D)
    _selected_backward_kernel[(item_key.numel(),)](
        q, do, descriptor(k, cfg["BLOCK_N"]), descriptor(v, cfg["BLOCK_N"]), lse, delta, dk_out, dv_out, dqpart,
        item_key, item_start, item_count, entries,
        *((layout.block_start, layout.block_end) if layout is not None else (None, None)),
        q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
        dk_out.stride(0), dk_out.stride(1), dk_out.stride(2), dv_out.stride(0), dv_out.stride(1), dv_out.stride(2),
        T, G, num_block_keys(T, cfg["BLOCK_N"], layout), scale * LOG2E, scale, n=n, h=H // G, D=D,
        WRITE_DQ=write_dq, PARTIALS=partials, DQ_ADD=dq_add, PACKED=layout is not None,
        **dict(zip(("sdqb", "sdqt", "sdqh"), dqpart.stride()[:3])), **cfg,
    )
