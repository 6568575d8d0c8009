"""The block-centric selected forward (nsa.ops.triton.selected_attention.block_partials) for Hopper GPUs, in Gluon.

Same contract as the Triton kernel: one program per work item of the inverse index (one key block and at most
`Tuning.inverse_chunk` of the queries that chose it). Each of the item's (query, head) rows gets its softmax over
the block's keys: the partial output, normalised, and its log-sum-exp (log2 units), written to the per-slot
buffers that selected_attention.finalize merges. A row sees exactly one block here, so there is no online softmax:
one S = Q K^T and one O = P V per row step. The schedule is selected_backward.py's:

- the block's keys and values arrive once by TMA;
- each row step's queries and entries are copied by cp.async into a ring of shared-memory stages from the
  addresses the entries give (a TMA box cannot gather), the copies of later steps in flight while the current
  one computes;
- S and P V run as wgmma; only the first steps (queries inside the block: entries are sorted by query) and a
  last partial step apply the causal mask.

Packed documents: block j is the stream's j-th selection block (nsa.ops.packing), starting at its document's
token BLOCK_START[j]. A block cut short by its document's end is the document's last, so every query that chose it
lies inside it and the causal mask alone keeps the next document's keys out.
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
from ..tuning import TUNING
from .common import (block_first, descriptor, item_block, layout_ok, load_block, masked_rows, ring_turn,
                     row_io_layout, rows_copyable, step_entries, wgmma_layout)


@gluon.jit
def _load_rows(Q, ENTRIES, q_smem, ent_smem, stage, f, f_ok, start, r0, rows, b, g, bg, T, sqb, sqt, sqh,
               n: gl.constexpr, h: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, io: gl.constexpr,
               vec: gl.constexpr):
    """cp.async of a row step into a ring stage: the q rows at the tokens of entries f (io's row layout) and each
    row's entry (vec layout), which gives its partial's place."""
    r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    t = (gl.where(f_ok, f // n - bg * T, 0)).to(gl.int64)[:, None]
    hd = (g * h + r % h).to(gl.int64)[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, io))[None, :]
    async_copy.async_copy_global_to_shared(q_smem.index(stage), Q + (b * sqb + t * sqt + hd * sqh + d),
                                           mask=f_ok[:, None])
    rv = r0 + gl.arange(0, BLOCK_M, layout=vec)
    async_copy.async_copy_global_to_shared(ent_smem.index(stage), ENTRIES + start + rv // h, mask=rv < rows)


@gluon.jit
def _selected_forward_kernel(
    Q, k_desc, v_desc, OPART, LSEPART, ITEM_KEY, ITEM_START, ITEM_COUNT, ENTRIES, BLOCK_START,
    sqb, sqt, sqh, T, G, NS, scale_log2,
    n: gl.constexpr, h: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, PACKED: gl.constexpr = False,
):
    item = gl.program_id(0)
    count = gl.load(ITEM_COUNT + item)
    if count > 0:
        start, j, bg, b32, b, g = item_block(ITEM_KEY, ITEM_START, item, NS, G)
        dtype: gl.constexpr = k_desc.dtype

        s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N)  # rows x keys
        o_layout: gl.constexpr = wgmma_layout(num_warps, D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        io: gl.constexpr = row_io_layout(num_warps, D)
        io_row: gl.constexpr = gl.SliceLayout(1, io)
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

        k_first = block_first(BLOCK_START, j, BLOCK_N, PACKED)
        rows = count * h
        n_steps = gl.cdiv(rows, BLOCK_M)
        # The causal mask applies to the rows before `split` and on a last partial step.
        split = masked_rows(ENTRIES, start, count, bg, T, k_first, n, h, BLOCK_N, vec)
        full_end = (rows // BLOCK_M) * BLOCK_M

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype))
        ent_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()
        load_block(k_desc, v_desc, kv_bar, k_smem, v_smem, b32 * T + k_first, g * D)
        for i in gl.static_range(STAGES - 1):
            if i < n_steps:
                f_ok, f = step_entries(ENTRIES, start, i * BLOCK_M, rows, h, BLOCK_M, io_row)
                _load_rows(Q, ENTRIES, q_smem, ent_smem, i, f, f_ok, start, i * BLOCK_M, rows, b, g, bg, T,
                           sqb, sqt, sqh, n, h, D, BLOCK_M, io, vec)
            async_copy.commit_group()  # one group per step, empty or not, so wait_group counts steps

        key = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        d_io = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        mbarrier.wait(kv_bar, 0)
        for s in range(n_steps):
            r0 = s * BLOCK_M
            stage = s % STAGES
            nxt_r0, f_ok, f = ring_turn(ENTRIES, start, r0, rows, h, BLOCK_M, STAGES, io_row)
            # Step s + STAGES - 1 goes into step s - 1's stage: its product and reads finished before this barrier.
            if s + STAGES - 1 < n_steps:
                _load_rows(Q, ENTRIES, q_smem, ent_smem, (s + STAGES - 1) % STAGES, f, f_ok, start, nxt_r0, rows,
                           b, g, bg, T, sqb, sqt, sqh, n, h, D, BLOCK_M, io, vec)
            async_copy.commit_group()
            sc = warpgroup_mma(q_smem.index(stage), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            if (r0 < split) | (r0 >= full_end):
                r = r0 + gl.arange(0, BLOCK_M, layout=row_s)
                # Rows past the item's end see the whole block: finite, and never stored.
                t = gl.where(r < rows, ent_smem.index(stage).load(row_s) // n - bg * T, k_first + BLOCK_N)
                sc = gl.where(key[None, :] <= t[:, None], sc, float("-inf"))
            m = gl.max(sc, 1) * scale_log2  # a selected block always holds a key <= t
            p = gl.exp2(sc * scale_log2 - m[:, None])
            l_sum = gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o = warpgroup_mma(p_op, v_smem, o_zero, use_acc=False, is_async=True)
            o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
            # The partials' places: row (entry f, head hh) of the item is part f * h + hh.
            rl = r0 + gl.arange(0, BLOCK_M, layout=row_s)
            part_l = ent_smem.index(stage).load(row_s).to(gl.int64) * h + rl % h
            gl.store(LSEPART + part_l, m + gl.log2(l_sum), mask=rl < rows)
            out = o * gl.convert_layout(1.0 / l_sum, gl.SliceLayout(1, o_layout))[:, None]
            rq = r0 + gl.arange(0, BLOCK_M, layout=io_row)
            part = ent_smem.index(stage).load(io_row).to(gl.int64) * h + rq % h
            gl.store(OPART + (part * D)[:, None] + d_io[None, :], gl.convert_layout(out.to(dtype), io),
                     mask=(rq < rows)[:, None])
        async_copy.wait_group(0)
        mbarrier.invalidate(kv_bar)


def config(d: int) -> dict:
    """Rows per step (a warp per 16), keys per block, stages of the rows' ring."""
    return dict(BLOCK_M=64, BLOCK_N=64, STAGES=TUNING.gluon_selected_forward_stages, num_warps=4)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel_block: int) -> bool:
    """Whether this kernel can take the call: common.layout_ok, q's rows copyable in 16-byte pieces, and a key tile
    that is exactly one selection block."""
    return (layout_ok(q, k, v) and rows_copyable(q) and sel_block == config(q.shape[-1])["BLOCK_N"])


def launch(q, k, v, inverse, opart, lsepart, scale: float, n: int, layout: PackedLayout | None = None) -> None:
    """block_partials's work on Hopper: every (query, slot, head)'s partial output and log-sum-exp (log2 units) over
    its block, into opart [B*G*T*n, h, D] and lsepart [B*G*T*n, h]; with `layout`, one packed stream of documents
    (`inverse` built with it)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    item_key, item_start, item_count, entries = inverse
    cfg = config(D)
    _selected_forward_kernel[(item_key.numel(),)](
        q, descriptor(k, cfg["BLOCK_N"]), descriptor(v, cfg["BLOCK_N"]), opart, lsepart,
        item_key, item_start, item_count, entries, layout.block_start if layout is not None else None,
        q.stride(0), q.stride(1), q.stride(2), T, G, num_block_keys(T, cfg["BLOCK_N"], layout), scale * LOG2E, n=n,
        h=H // G, D=D, PACKED=layout is not None, **cfg,
    )
