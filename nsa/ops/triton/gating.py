"""Backward of the gated sum: gate gradients and each branch's softmax delta in one pass.

o = sum_c g_c * o_c, so dL/dg_c = rowsum(do * o_c), and branch c's attention backward
needs delta_c = rowsum((g_c * do) * o_c) = g_c * dL/dg_c.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_grads_kernel(
    DO, O_CMP, O_SEL, O_WIN, GATES, DGATES, DELTA,
    sob, sot, soh, sgb, sgt, sgh, sdb, sdt, sdh, s_delta_c,
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
    out_off = b * sdb + t * sdt + head * sdh
    for c in tl.static_range(3):
        o_ptr = O_CMP if c == 0 else (O_SEL if c == 1 else O_WIN)
        dg = tl.sum(do * tl.load(o_ptr + off, mask=mask, other=0.0).to(tl.float32), 1)
        g = tl.load(GATES + gate_off + c, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(DGATES + gate_off + c, dg.to(DGATES.dtype.element_ty), mask=row_ok)
        tl.store(DELTA + c * s_delta_c + out_off, g * dg, mask=row_ok)


def gate_grads(do: torch.Tensor, o_cmp, o_sel, o_win, gates: torch.Tensor):
    """(dgates [B,T,H,3] in gates' dtype, delta [3,B,T,H] float32). All [B,T,H,*] inputs share strides."""
    B, T, H, Dv = do.shape
    dgates = torch.empty_like(gates)
    delta = torch.empty(3, B, T, H, device=do.device, dtype=torch.float32)
    on_gpu = do.device.type == "cuda"
    block_m = 32 if on_gpu else 16
    _gate_grads_kernel[(triton.cdiv(B * T * H, block_m),)](
        do, o_cmp, o_sel, o_win, gates, dgates, delta,
        do.stride(0), do.stride(1), do.stride(2), gates.stride(0), gates.stride(1), gates.stride(2),
        delta.stride(1), delta.stride(2), delta.stride(3), delta.stride(0),
        B * T * H, H, T, DV=Dv, BLOCK_DV=max(16, triton.next_power_of_2(Dv)), BLOCK_M=block_m,
        num_warps=4 if on_gpu else 1,
    )
    return dgates, delta
