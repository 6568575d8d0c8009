"""Probe: can a hand-scheduled Hopper kernel (Gluon: TMA loads, async wgmma, softmax overlapped with the P.V
product) beat our Triton kernels per unit of work at head dim 64? Dense causal GQA attention forward at M7C's
shape, checked against SDPA and timed against flash, cuDNN and our range kernel in window mode with w = T (the
same causal work). Not product code: it answers whether a Gluon rewrite of the NSA kernels would pay.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/gluon_probe.py [--T 2048 --batch 16]'
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
VARIANTS = [  # rows, keys per step, K/V stages, warps, softmax overlapped with the P.V product
    (128, 64, 3, 8, True), (128, 64, 3, 8, False), (128, 128, 3, 8, True), (128, 64, 2, 4, True),
    (64, 64, 3, 4, True), (64, 64, 3, 4, False), (64, 64, 4, 4, True), (64, 128, 3, 4, True), (64, 128, 2, 4, False),
]


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, O, T, H, G, qk_scale, sob, sot, soh,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    hh = pid_bh % H
    g = hh // (H // G)
    q0 = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * T + q0, hh * D], q_bar, q_smem)
    n_tiles = gl.cdiv(gl.minimum(q0 + BLOCK_M, T), BLOCK_N)
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    for i in gl.static_range(STAGES - 1):
        if i < n_tiles:
            mbarrier.expect(kv_bar.index(i), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [b * T + i * BLOCK_N, g * D], kv_bar.index(i), k_smem.index(i))
            tma.async_copy_global_to_shared(v_desc, [b * T + i * BLOCK_N, g * D], kv_bar.index(i), v_smem.index(i))

    rows = q0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    # Tile 0: its scores, then the loop issues tile j's scores before the P.V product of tile j - 1, so the
    # tensor cores work on one while the softmax of the other runs.
    mbarrier.wait(kv_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    cols = gl.arange(0, BLOCK_N, layout=col_s)
    s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    m_i = m_new
    for j in range(1, n_tiles):
        # Tile j + STAGES - 2 goes into tile j - 2's stage, free since its P.V was awaited last iteration (tile
        # j - 1's V is still to be read, hence at least two stages).
        nxt = j + STAGES - 2
        if nxt < n_tiles:
            st = nxt % STAGES
            mbarrier.expect(kv_bar.index(st), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [b * T + nxt * BLOCK_N, g * D], kv_bar.index(st), k_smem.index(st))
            tma.async_copy_global_to_shared(v_desc, [b * T + nxt * BLOCK_N, g * D], kv_bar.index(st), v_smem.index(st))
        st = j % STAGES
        mbarrier.wait(kv_bar.index(st), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        pv = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), acc, is_async=True)
        if OVERLAP:
            s = warpgroup_mma_wait(1, deps=(s,))
        else:
            s = warpgroup_mma_wait(0, deps=(s,))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
        if j * BLOCK_N + BLOCK_N > q0:  # the diagonal's tiles
            s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # p_op (the product's register operand) stays alive until the product is done.
        acc, p_op = warpgroup_mma_wait(0, deps=(pv, p_op))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index((n_tiles - 1) % STAGES), acc)
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    orow = q0 + gl.arange(0, BLOCK_M, layout=row_o)
    ocol = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptr = O + b * sob + orow[:, None] * sot + hh * soh + ocol[None, :]
    gl.store(ptr, out.to(dtype), mask=orow[:, None] < T)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))


def gluon_attention(q, k, v, block_m=128, block_n=64, stages=3, warps=8, overlap=True):
    """Causal GQA attention: q [B,T,H,D], k/v [B,T,G,D] (contiguous, bf16) -> [B,T,H,D]."""
    B, T, H, D = q.shape
    G = k.shape[2]
    assert stages >= 2 and T % block_m == 0
    q2, k2, v2 = q.view(B * T, H * D), k.view(B * T, G * D), v.view(B * T, G * D)
    lay_q = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.bfloat16)
    lay_k = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, D], lay_q)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, D], lay_k)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, D], lay_k)
    o = torch.empty_like(q)
    grid = (T // block_m, B * H)
    _attn_fwd[grid](qd, kd, vd, o, T, H, G, D**-0.5 * LOG2E, o.stride(0), o.stride(1), o.stride(2),
                    BLOCK_M=block_m, BLOCK_N=block_n, D=D, STAGES=stages, OVERLAP=overlap, num_warps=warps)
    return o


def compile_for_sm90(block_m: int, block_n: int, stages: int, warps: int, overlap: bool, D: int = 64):
    """The kernel compiled for an H100 without a GPU (Triton's own ptxas): check it builds, read its registers."""
    from offline_compile import compile_gluon  # benchmarks/, beside this script

    rows = torch.empty(256, 12 * D, dtype=torch.bfloat16)
    layout = lambda n: gl.NVMMASharedLayout.get_default_for([n, D], gl.bfloat16)  # noqa: E731
    desc = lambda n: TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [n, D], layout(n))  # noqa: E731
    descriptors = {"q_desc": desc(block_m), "k_desc": desc(block_n), "v_desc": desc(block_n)}
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=D, STAGES=stages, OVERLAP=overlap)
    return compile_gluon(_attn_fwd, descriptors, consts, {"O": "*bf16", "qk_scale": "fp32"}, warps)


def main() -> None:
    from nsa.bench.common import time_cuda
    from nsa.ops.triton import range_attention as ra
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--offline", action="store_true", help="only compile each variant for sm_90 (no GPU needed)")
    ns = p.parse_args()
    if ns.offline:
        from offline_compile import report  # benchmarks/, beside this script

        for variant in VARIANTS:
            print(variant, report(compile_for_sm90(*variant)), flush=True)
        return
    B, T, H, G, D = ns.batch, ns.T, ns.heads, ns.groups, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (H, G, G))
    qd = q.transpose(1, 2).contiguous()
    kd, vd = (t.repeat_interleave(H // G, 2).transpose(1, 2).contiguous() for t in (k, v))
    ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), is_causal=True).transpose(1, 2)
    flops = 4 * B * H * T * T / 2 * D
    rows = []

    def report(name, fn):
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = time_cuda(fn, queued=True)
        rows.append((name, ms, flops / ms / 1e9, err))
        print(f"{name:36s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel err {err:.2e}", flush=True)

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(1, 2)
        return run

    print(f"causal GQA forward, B={B} T={T} H={H} G={G} D={D}, bf16, {torch.cuda.get_device_name()}")
    report("SDPA flash", sdpa(SDPBackend.FLASH_ATTENTION))
    report("SDPA cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION))
    report("ours: range kernel, window = T",
           lambda: ra.range_attention_fwd(q, k, v, ra.MODE_WIN, D**-0.5, 32, 16, T)[0])
    for bm, bn, st, w, ov in VARIANTS:
        name = f"gluon M{bm} N{bn} S{st} W{w}{' overlap' if ov else ''}"
        try:
            report(name, lambda: gluon_attention(q, k, v, bm, bn, st, w, ov))
        except Exception as e:  # a configuration that does not compile is a result too
            print(f"{name:36s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
