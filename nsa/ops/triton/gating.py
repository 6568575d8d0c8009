"""Backward of the gated sum: gate gradients, and each branch's gate folded into its backward's row statistics.

o = sum_c g_c * o_c, so dL/dg_c = rowsum(do * o_c), and branch c's attention backward sees
do_c = g_c * do. With P = exp(s - lse_c) and D = rowsum(do_c * o_c) = g_c * dL/dg_c:

    dV = P^T do_c = (g_c P)^T do,    dS = P * (do_c V^T - D) = (g_c P) * (do V^T - dL/dg_c),

and g_c P = exp(s - (lse_c - ln g_c)). So each branch's backward runs as plain attention
backward on the ungated do with lse_c - ln g_c and delta dL/dg_c: no per-row gate to load
inside the kernels' loops (a strided bf16 load the pipeliner cannot make asynchronous) and
no gated copy of do. A gate of 0 gives lse +inf (P = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import TUNING
from . import launcher
from .common import ceil_div, next_power_of_two


@triton.jit
def _gate_grads_kernel(
    DO, O_CMP, O_SEL, O_WIN, GATES, LSE_CMP, LSE_SEL, LSE_WIN, DGATES, DELTA, LSE_G,
    sob, sot, soh, sgb, sgt, sgh, slb, slt, slh, sdb, sdt, sdh, s_delta_c,
    n_rows, H, T,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    b = (rows // (T * H)).to(tl.int64)
    t = ((rows // H) % T).to(tl.int64)
    head = (rows % H).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (dv[None, :] < DV)
    off = (b * sob + t * sot + head * soh)[:, None] + dv[None, :]
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    gate_off = b * sgb + t * sgt + head * sgh
    lse_off = b * slb + t * slt + head * slh
    out_off = b * sdb + t * sdt + head * sdh
    for c in tl.static_range(3):
        o_ptr = O_CMP if c == 0 else (O_SEL if c == 1 else O_WIN)
        lse_ptr = LSE_CMP if c == 0 else (LSE_SEL if c == 1 else LSE_WIN)
        dg = tl.sum(do * tl.load(o_ptr + off, mask=mask, other=0.0).to(tl.float32), 1)
        g = tl.load(GATES + gate_off + c, mask=row_ok, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + lse_off, mask=row_ok, other=0.0)
        tl.store(DGATES + gate_off + c, dg.to(DGATES.dtype.element_ty), mask=row_ok)
        tl.store(DELTA + c * s_delta_c + out_off, dg, mask=row_ok)
        # lse = -inf (the row saw no key) stays -inf unless the gate is 0; both give P = 0 where it is used.
        lse_g = tl.where(g > 0, lse - tl.log(tl.where(g > 0, g, 1.0)), float("inf"))
        tl.store(LSE_G + c * s_delta_c + out_off, lse_g, mask=row_ok)


def gate_grads(do: torch.Tensor, o_cmp, o_sel, o_win, gates: torch.Tensor, lse_cmp, lse_sel, lse_win):
    """(dgates [B,T,H,3] in gates' dtype, delta [3,B,T,H] = dL/dg_c and lse_g [3,B,T,H] = lse_c - ln g_c, both
    float32): what each branch's backward takes in place of its gate. The [B,T,H,Dv] inputs share strides, as
    do the three lse [B,T,H]."""
    B, T, H, Dv = do.shape
    dgates = torch.empty_like(gates)
    delta = torch.empty(3, B, T, H, device=do.device, dtype=torch.float32)
    lse_g = torch.empty_like(delta)
    on_gpu = do.device.type == "cuda"
    block_m = TUNING.gate_block_m if on_gpu else 16
    launcher.launch(_gate_grads_kernel, (ceil_div(B * T * H, block_m),),
        do, o_cmp, o_sel, o_win, gates, lse_cmp, lse_sel, lse_win, dgates, delta, lse_g,
        do.stride(0), do.stride(1), do.stride(2), gates.stride(0), gates.stride(1), gates.stride(2),
        lse_cmp.stride(0), lse_cmp.stride(1), lse_cmp.stride(2),
        delta.stride(1), delta.stride(2), delta.stride(3), delta.stride(0),
        B * T * H, H, T, DV=Dv, BLOCK_DV=max(16, next_power_of_two(Dv)), BLOCK_M=block_m,
        num_warps=TUNING.gate_warps if on_gpu else 1,
    )
    return dgates, delta, lse_g
