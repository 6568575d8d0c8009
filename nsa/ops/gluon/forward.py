"""The span forward (compressed, window and tiled selected branches, and the gated sum) for Hopper GPUs, in Gluon.

Same contract as nsa.ops.triton.span_attention.forward. The Triton kernel leaves the tensor cores idle much of the
time at head dim 64; here the schedule is explicit:

- one program per tile of (token, head) rows of a key/value group, packed as the Triton span kernels pack them: its
  queries are loaded once into shared memory, the group's keys and values of the next steps arrive by TMA into a
  ring of shared-memory stages guarded by mbarriers;
- S = Q K^T and O += P V run as asynchronous wgmma; step i's S is issued before step i-1's P V, and that product is
  awaited only after step i's softmax, so the tensor cores and the softmax overlap;
- few enough registers (sm_90) for three programs to share an SM.

A launch costs more host time than Triton's (it builds TMA descriptors), which only short calls run back to back
expose. backward.py and query_grad.py are the backward's kernels built the same way.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..geometry import NSAGeometry
from ..packing import PackedLayout
from ..triton.common import LOG2E
from ..tuning import TUNING
from .common import descriptor, document_key_range, key_range, layout_ok, load_kv


@gluon.jit
def _tile_scores(s, start, lo, hi, bits, cols, scale_log2, m_i, l_i, sel_block, MASKED, MODE: gl.constexpr):
    """One online-softmax step over raw scores s of the keys start + cols: (p, alpha, m, l); m in log2 units.
    Keys outside a row's range (edge tiles only) and, for the selected branch, blocks the row did not choose
    (one bit per row: a tile lies in one block) get p = 0; rows that saw nothing yet keep m = -inf."""
    if MASKED:
        key = start + cols
        s = gl.where((key[None, :] >= lo[:, None]) & (key[None, :] <= hi[:, None]), s, float("-inf"))
    row_max = gl.max(s, 1) * scale_log2
    if MODE == 2:
        pick = ((bits >> (start // sel_block)) & 1) != 0
        row_max = gl.where(pick, row_max, float("-inf"))
    m_new = gl.maximum(m_i, row_max)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if MODE == 2:
        m_exp = gl.where(pick, m_safe, float("inf"))
    else:
        m_exp = m_safe
    p = gl.exp2(s * scale_log2 - m_exp[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _span_forward_kernel(
    Q, k_desc, v_desc, O, LSE, BITS, O_CMP, O_WIN, GATES, OUT, DOC_START, CMP_START,
    sqb, sqt, sqh, sob, sot, soh, slb, slt, sbb, sbt, sbg, sgb, sgt, sgh,
    T, NK, G, scale_log2, block_len, block_stride, window, sel_block,
    h: gl.constexpr, MODE: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr,
    PACKED: gl.constexpr = False,
):
    pid_m = gl.program_id(0)
    pid_bg = gl.program_id(1)
    b32 = pid_bg // G  # TMA coordinates are 32-bit; pointer offsets use b, 64-bit
    b = b32.to(gl.int64)
    g = pid_bg % G
    dtype: gl.constexpr = k_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Rows are (token, head) pairs of one key/value group, row r <-> token r // h, head r % h (the Triton span
    # kernels' packing): every key/value tile serves the group's h heads.
    io: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DV // 8), DV // 8], [num_warps, 1], [1, 0])
    qio: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DK // 8), DK // 8], [num_warps, 1], [1, 0])

    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    row_ok = rows < T * h
    t = rows // h
    if PACKED:  # one stream of documents (B = 1; MODE_CMP or MODE_WIN): each row's range inside its document
        lo, hi = document_key_range(t, row_ok, DOC_START, CMP_START, MODE, block_len, block_stride, window)
    else:
        lo, hi = key_range(t, row_ok, MODE, block_len, block_stride, window)
    # The program's keys: from the first token's first key to the last token's last one.
    k_start = (gl.min(gl.where(row_ok, lo, NK), 0) // BLOCK_N) * BLOCK_N
    k_end = gl.max(hi, 0) + 1
    # Key steps inside [a, e) are seen whole by every row: no range mask there (none when the rows' documents
    # differ: the later one's first key follows the earlier one's last).
    a = gl.max(gl.where(row_ok, lo, 0), 0)
    e = gl.min(gl.where(row_ok, hi, NK), 0) + 1
    # At least one step, fully masked when the tile sees no key (rows that see none end with lse = -inf).
    n_tiles = gl.maximum(gl.cdiv(k_end - k_start, BLOCK_N), 1)
    bits = t.to(gl.int64) * 0
    if MODE == 2:
        bits = gl.load(BITS + b * sbb + t.to(gl.int64) * sbt + g * sbg, mask=row_ok, other=0)

    # The rows' queries: loaded once, so by plain 16-byte loads into shared memory (a TMA box cannot start
    # mid-token).
    qr = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, qio))
    qd = gl.arange(0, DK, layout=gl.SliceLayout(0, qio))
    q_off = b * sqb + (qr // h).to(gl.int64)[:, None] * sqt + (g * h + qr % h).to(gl.int64)[:, None] * sqh
    q_val = gl.load(Q + q_off + qd[None, :], mask=(qr < T * h)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DK], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DK],
                                                                                                   dtype), q_val)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DK], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # the queries' stores before the tensor cores read them
    row0 = b32 * NK + k_start
    for i in gl.static_range(STAGES - 1):
        if i < n_tiles:
            load_kv(k_desc, v_desc, bars, k_smem, v_smem, i, row0, g * DK, g * DV, BLOCK_N, STAGES)

    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # Step 0, then each step issues its S before the previous step's P V and awaits that product only after
    # its own softmax.
    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, alpha, m_i, l_i = _tile_scores(s, k_start, lo, hi, bits, cols, scale_log2, m_i, l_i, sel_block,
                                      (k_start < a) | (k_start + BLOCK_N > e), MODE)
    for i in range(1, n_tiles):
        # Step i + STAGES - 2 goes into step i - 2's stage, free since its P V was awaited last step.
        if i + STAGES - 2 < n_tiles:
            load_kv(k_desc, v_desc, bars, k_smem, v_smem, i + STAGES - 2, row0, g * DK, g * DV, BLOCK_N, STAGES)
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        pv = warpgroup_mma(p_op, v_smem.index((i - 1) % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        start = k_start + i * BLOCK_N
        p, alpha, m_i, l_i = _tile_scores(s, start, lo, hi, bits, cols, scale_log2, m_i, l_i, sel_block,
                                          (start < a) | (start + BLOCK_N > e), MODE)
        # p_op, the product's register operand, must live until the product is done.
        acc, p_op = warpgroup_mma_wait(0, deps=(pv, p_op))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index((n_tiles - 1) % STAGES), acc)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    head = g * h + rows % h
    gl.store(LSE + b * slb + t.to(gl.int64) * slt + head, lse, mask=row_ok)
    out = (acc / gl.convert_layout(l_safe, row_o)[:, None]).to(dtype)
    # The stores (and the gated sum's loads) in a row-major layout: 16-byte accesses, not the accumulator's.
    out = gl.convert_layout(out, io)
    r = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    ok = (r < T * h)[:, None]
    tok = (r // h).to(gl.int64)[:, None]
    hd = (g * h + r % h).to(gl.int64)[:, None]
    dv = gl.arange(0, DV, layout=gl.SliceLayout(0, io))
    o_off = b * sob + tok * sot + hd * soh + dv[None, :]
    gl.store(O + o_off, out, mask=ok)
    if GATED:
        # The gated sum of the three branches (all [B,T,H,Dv] with O's strides), this one as stored.
        gate = GATES + b * sgb + tok * sgt + hd * sgh
        total = gl.load(gate + 1, mask=ok, other=0.0).to(gl.float32) * out.to(gl.float32)
        total += gl.load(gate, mask=ok, other=0.0).to(gl.float32) * gl.load(O_CMP + o_off, mask=ok, other=0.0).to(
            gl.float32)
        total += gl.load(gate + 2, mask=ok, other=0.0).to(gl.float32) * gl.load(O_WIN + o_off, mask=ok, other=0.0).to(
            gl.float32)
        gl.store(OUT + o_off, total.to(dtype), mask=ok)


def config(d: int) -> dict:
    """Rows ((token, head) pairs) and keys per step, stages of the key/value ring, warps."""
    if d <= 64:  # a warp per 16 rows: 128 rows on 4 warps spill (compiled for sm_90), on 8 they need more registers
        rows = TUNING.gluon_block_m
        return dict(BLOCK_M=rows, BLOCK_N=64, STAGES=TUNING.gluon_stages, num_warps=max(4, rows // 16))
    return dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: int, sel_block: int,
             layout: PackedLayout | None = None) -> bool:
    """Whether this kernel can take the call: common.layout_ok, for the selected branch whole blocks per key step,
    and packed documents (`layout`) for the compressed and window branches (the tiled selected branch's steps do
    not align with a document's blocks: Triton's kernel takes it)."""
    if layout is not None and mode == 2:
        return False
    return layout_ok(q, k, v) and (mode != 2 or sel_block % config(q.shape[-1])["BLOCK_N"] == 0)


def launch(q, k, v, o, lse, mode: int, scale: float, geometry: NSAGeometry, bits, bit_strides: tuple, gated,
           out, layout: PackedLayout | None = None) -> None:
    """The span forward into o and lse (and out = the gated sum, with gated = (o_cmp, o_win, gates)); bits and
    bit_strides as span_attention.selection_args gives them; with `layout`, one packed stream of documents."""
    B, T, H, D = q.shape
    NK, G = k.shape[1], k.shape[2]
    cfg = config(D)
    o_cmp, o_win, gates = gated if gated is not None else (o, o, lse)
    gate_strides = gates.stride()[:3] if gated is not None else (0, 0, 0)
    tables = (layout.doc_start, layout.cmp_start) if layout is not None else (None, None)
    grid = (-(-T * (H // G) // cfg["BLOCK_M"]), B * G)
    _span_forward_kernel[grid](
        q, descriptor(k, cfg["BLOCK_N"]), descriptor(v, cfg["BLOCK_N"]), o, lse, bits, o_cmp, o_win, gates, out,
        *tables, q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
        lse.stride(1), *bit_strides, *gate_strides, T, NK, G, scale * LOG2E, geometry.block_len,
        geometry.block_stride, geometry.window, geometry.sel_block, h=H // G, MODE=mode, DK=D, DV=D,
        GATED=gated is not None, PACKED=layout is not None, **cfg,
    )
