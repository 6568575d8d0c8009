"""What the block-centric selected forward's per-slot partial stores cost it, at M7C 32k x 2 on one selection.

A copy of nsa/ops/triton/hopper_selected_forward.py's kernel with its epilogue chosen by STORE:
  0  as the library: the normalised output converted to 16-byte row pieces (a shared-memory round trip), stored;
  1  nothing stored per row step: each row's output and log-sum-exp summed into registers, one store a program
     at the end (so the products stay live); the compute and the gathers alone;
  2  the output stored straight from the wgmma accumulator's layout (4-byte pieces, no conversion).
Times are GPU milliseconds of calls queued back to back (nsa.bench.common.time_cuda), medians of rounds; STORE=2
is checked against STORE=0 bit for bit.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/history/2026-11-27-h100-s32-ceiling/fwd_store_probe.py'
"""
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import time_cuda
from nsa.ops import select_blocks
from nsa.ops.triton.common import LOG2E
from nsa.ops.triton.hopper_backward import row_io_layout, wgmma_layout
from nsa.ops.triton.hopper_forward import _descriptor
from nsa.ops.triton.hopper_selected_backward import _item_block, _load_block, _masked_rows, _ring_turn, _step_entries
from nsa.ops.triton.hopper_selected_forward import _load_rows, hopper_selected_forward_config, selected_forward_hopper
from nsa.ops.triton.selected_attention import build_inverse_index


@gluon.jit
def _probe_kernel(
    Q, k_desc, v_desc, OPART, LSEPART, SINK, ITEM_KEY, ITEM_START, ITEM_COUNT, ENTRIES,
    sqb, sqt, sqh, T, G, NS, scale_log2,
    n: gl.constexpr, h: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, STORE: gl.constexpr, num_warps: gl.constexpr,
):
    item = gl.program_id(0)
    count = gl.load(ITEM_COUNT + item)
    if count > 0:
        start, j, bg, b32, b, g = _item_block(ITEM_KEY, ITEM_START, item, NS, G)
        dtype: gl.constexpr = k_desc.dtype
        s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(num_warps, D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        io: gl.constexpr = row_io_layout(num_warps, D)
        io_row: gl.constexpr = gl.SliceLayout(1, io)
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        k_first = j * BLOCK_N
        rows = count * h
        n_steps = gl.cdiv(rows, BLOCK_M)
        split = _masked_rows(ENTRIES, start, count, bg, T, k_first, n, h, BLOCK_N, vec)
        full_end = (rows // BLOCK_M) * BLOCK_M
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype))
        ent_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()
        _load_block(k_desc, v_desc, kv_bar, k_smem, v_smem, b32 * T + k_first, g * D)
        for i in gl.static_range(STAGES - 1):
            if i < n_steps:
                f_ok, f = _step_entries(ENTRIES, start, i * BLOCK_M, rows, h, BLOCK_M, io_row)
                _load_rows(Q, ENTRIES, q_smem, ent_smem, i, f, f_ok, start, i * BLOCK_M, rows, b, g, bg, T,
                           sqb, sqt, sqh, n, h, D, BLOCK_M, io, vec)
            async_copy.commit_group()
        key = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        d_io = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        sink = gl.zeros([BLOCK_M], gl.float32, layout=row_o)
        mbarrier.wait(kv_bar, 0)
        for s in range(n_steps):
            r0 = s * BLOCK_M
            stage = s % STAGES
            nxt_r0, f_ok, f = _ring_turn(ENTRIES, start, r0, rows, h, BLOCK_M, STAGES, io_row)
            if s + STAGES - 1 < n_steps:
                _load_rows(Q, ENTRIES, q_smem, ent_smem, (s + STAGES - 1) % STAGES, f, f_ok, start, nxt_r0, rows,
                           b, g, bg, T, sqb, sqt, sqh, n, h, D, BLOCK_M, io, vec)
            async_copy.commit_group()
            sc = warpgroup_mma(q_smem.index(stage), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            if (r0 < split) | (r0 >= full_end):
                r = r0 + gl.arange(0, BLOCK_M, layout=row_s)
                t = gl.where(r < rows, ent_smem.index(stage).load(row_s) // n - bg * T, k_first + BLOCK_N)
                sc = gl.where(key[None, :] <= t[:, None], sc, float("-inf"))
            m = gl.max(sc, 1) * scale_log2
            p = gl.exp2(sc * scale_log2 - m[:, None])
            l_sum = gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o = warpgroup_mma(p_op, v_smem, o_zero, use_acc=False, is_async=True)
            o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
            rl = r0 + gl.arange(0, BLOCK_M, layout=row_s)
            out = o * gl.convert_layout(1.0 / l_sum, row_o)[:, None]
            if STORE == 1:
                sink += gl.sum(out, 1) + gl.convert_layout(m + gl.log2(l_sum), row_o)
            else:
                part_l = ent_smem.index(stage).load(row_s).to(gl.int64) * h + rl % h
                gl.store(LSEPART + part_l, m + gl.log2(l_sum), mask=rl < rows)
                if STORE == 0:
                    rq = r0 + gl.arange(0, BLOCK_M, layout=io_row)
                    part = ent_smem.index(stage).load(io_row).to(gl.int64) * h + rq % h
                    gl.store(OPART + (part * D)[:, None] + d_io[None, :], gl.convert_layout(out.to(dtype), io),
                             mask=(rq < rows)[:, None])
                else:
                    ro = r0 + gl.arange(0, BLOCK_M, layout=row_o)
                    part_o = gl.convert_layout(part_l, row_o)
                    gl.store(OPART + (part_o * D)[:, None] + d_o[None, :], out.to(dtype), mask=(ro < rows)[:, None])
        async_copy.wait_group(0)
        mbarrier.invalidate(kv_bar)
        if STORE == 1:
            gl.store(SINK + item * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o), sink)


def main() -> None:
    H, G, D, _ = SHAPES["m7c"]
    sb, n = HP["sel_block"], HP["n_sel"]
    T, B = 32768, 2
    q, k_cmp, v_cmp, k, v, *_ = (x.detach() for x in make_inputs(T, H, G, D, D, batch=B))
    scale = D**-0.5
    idx = select_blocks(q, k_cmp, **{x: HP[x] for x in ("block_len", "block_stride", "sel_block", "n_sel")})
    inv = build_inverse_index(idx, T, sb)
    item_key, item_start, item_count, entries = inv
    h = H // G
    cfg = hopper_selected_forward_config(D)
    parts = [(torch.zeros(B * G * T * n, h, D, device="cuda", dtype=q.dtype),
              torch.zeros(B * G * T * n, h, device="cuda", dtype=torch.float32)) for _ in range(3)]
    sink = torch.zeros(item_key.numel() * cfg["BLOCK_M"], device="cuda")
    kd, vd = _descriptor(k, cfg["BLOCK_N"]), _descriptor(v, cfg["BLOCK_N"])

    def run(mode):
        opart, lsepart = parts[mode]
        _probe_kernel[(item_key.numel(),)](
            q, kd, vd, opart, lsepart, sink, item_key, item_start, item_count, entries,
            q.stride(0), q.stride(1), q.stride(2), T, G, -(-T // cfg["BLOCK_N"]), scale * LOG2E,
            n=n, h=h, D=D, STORE=mode, **cfg)

    lib = [torch.zeros_like(parts[0][0]), torch.zeros_like(parts[0][1])]
    runs = {"library": lambda: selected_forward_hopper(q, k, v, lib[0], lib[1], inv, scale, n),
            **{f"STORE={m}": (lambda m=m: run(m)) for m in range(3)}}
    for fn in runs.values():
        fn()
    torch.cuda.synchronize()
    same = lambda a, b: torch.equal(a, b)  # noqa: E731
    print("STORE=0 == library:", same(parts[0][0], lib[0]) and same(parts[0][1], lib[1]))
    print("STORE=2 == STORE=0:", same(parts[2][0], parts[0][0]) and same(parts[2][1], parts[0][1]))
    times = {name: [] for name in runs}
    for _ in range(5):
        for name, fn in runs.items():
            times[name].append(time_cuda(fn, queued=True))
    for name, t in times.items():
        print(f"{name:10s} {statistics.median(t):.3f} ms  (rounds {', '.join(f'{x:.3f}' for x in t)})")


if __name__ == "__main__":
    main()
