"""Building blocks shared by the NSA Gluon kernels: what they accept, TMA descriptors, layouts and @gluon.jit pieces.

- tensors: `layout_ok` (the tensors every Gluon kernel can take), `is_sm90`, `descriptor` (TMA tiles of keys or
  values);
- layouts: the wgmma result's and the row-major layouts of loads, stores and atomic adds;
- span keys: `key_range` (and `document_key_range`, `document_key_queries` for packed documents) and `load_kv`,
  the key/value ring of the forward and dQ kernels;
- gradients: `store_grad`, a dK or dV tile stored or added;
- work items: `item_block`, `block_first`, `masked_rows`, `load_block`, `step_entries` and `ring_turn`, the
  block-centric selected kernels' walk over an item of the inverse index.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_DTYPES = {torch.bfloat16: gl.bfloat16}
"""Input types the Gluon kernels serve: bf16, the one their GPU tests check (float16 takes the Triton kernels)."""


# ---------------------------------------------------------------- tensors


@functools.lru_cache(maxsize=None)
def is_sm90(device_index: int) -> bool:
    """Whether the CUDA device is a Hopper GPU (compute capability 9.0), the one these kernels are built for."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def on_sm90(x: torch.Tensor) -> bool:
    """Whether x lives on a Hopper GPU."""
    return x.is_cuda and is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())


def layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon kernels can take these tensors: an sm_90 GPU, bf16, head dims 64 or 128 with Dk == Dv,
    and keys and values whose tokens are rows of one stride (TMA tiles)."""
    if not (q.is_cuda and q.dtype in _DTYPES and k.dtype == q.dtype == v.dtype and on_sm90(q)):
        return False
    B, T, H, Dk = q.shape
    NK, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Dk != Dv or Dk not in (64, 128) or NK == 0 or H % G or q.stride(-1) != 1:
        return False
    # Keys and values are often views into the model's wider key/value projection: tokens one stride apart.
    return all(x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and (x.stride(1) * x.element_size()) % 16 == 0
               and (B == 1 or x.stride(0) == x.shape[1] * x.stride(1)) and x.data_ptr() % 16 == 0 for x in (k, v))


def rows_copyable(*tensors: torch.Tensor) -> bool:
    """Whether each [B,T,H,D] tensor's rows can be copied in 16-byte pieces: a unit last stride and 16-byte aligned
    data, with every other stride a multiple of 16 elements (the kernels compile their copies only then, by
    Triton's launch specialisation; contiguous [B,T,H,64|128] tensors qualify)."""
    return all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and not any(s % 16 for s in x.stride()[:3])
               for x in tensors)


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of a [rows, d] TMA tile, built once per shape (its construction is host time)."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], _DTYPES[dtype])


def descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """x [B,N,G,D] as TMA tiles of `rows` tokens x one group's D columns: a [B*N, G*D] matrix whose rows (tokens)
    lie x.stride(1) apart (layout_ok checked the layout)."""
    B, N, G, D = x.shape
    return TensorDescriptor(x, [B * N, G * D], [x.stride(1), 1], [rows, D], _tile_layout(rows, D, x.dtype))


# ---------------------------------------------------------------- layouts


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


# ---------------------------------------------------------------- span keys


@gluon.jit
def key_range(t, row_ok, MODE: gl.constexpr, block_len, block_stride, window):
    """First and last key each query token t sees (branches.MODE_*; rows past the end see none)."""
    if MODE == 0:
        lo = t * 0
        hi = gl.where(t >= block_len - 1, gl.maximum(t - block_len + 1, 0) // block_stride, -1)
    elif MODE == 1:
        lo = gl.maximum(t - window + 1, 0)
        hi = t
    else:
        lo = t * 0
        hi = t
    return lo, gl.where(row_ok, hi, -1)


@gluon.jit
def document_key_range(t, row_ok, DOC_START, CMP_START, MODE: gl.constexpr, block_len, block_stride, window):
    """Packed documents (nsa.ops.packing's per-token tables): key_range at each row's position in its document,
    moved onto the document's keys (its compressed rows for MODE_CMP, its tokens for MODE_WIN). Both bounds are
    non-decreasing in t, so a tile's rows bound its keys as they do without documents."""
    doc_start = gl.load(DOC_START + t, mask=row_ok, other=0)
    lo, hi = key_range(t - doc_start, row_ok, MODE, block_len, block_stride, window)
    if MODE == 0:
        base = gl.load(CMP_START + t, mask=row_ok, other=0)
    else:
        base = doc_start
    return lo + base, gl.where(row_ok, hi + base, -1)


@gluon.jit
def document_key_queries(key, NK, T, DOC_END, CMP_READY, CMP_DOC_END, MODE: gl.constexpr, window):
    """Packed documents: the first and last query token that sees each key (none: T and -1). A compressed row is
    seen from its block's last token to its document's end, a window key for at most `window` queries of its
    document (MODE_CMP and MODE_WIN)."""
    ok = key < NK
    if MODE == 0:
        q_first = gl.load(CMP_READY + key, mask=ok, other=T)
        q_last = gl.load(CMP_DOC_END + key, mask=ok, other=0) - 1
    else:
        q_first = gl.where(ok, key, T)
        q_last = gl.minimum(gl.load(DOC_END + key, mask=ok, other=0), key + window) - 1
    return q_first, q_last


@gluon.jit
def load_kv(k_desc, v_desc, bars, k_smem, v_smem, i, row0, col_k, col_v, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """Key step i's keys and values by TMA into ring stage i % STAGES, arriving on that stage's barrier."""
    stage = i % STAGES
    mbarrier.expect(bars.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, col_k], bars.index(stage), k_smem.index(stage))
    tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, col_v], bars.index(stage), v_smem.index(stage))


# ---------------------------------------------------------------- gradients


@gluon.jit
def store_grad(OUT, acc, b, g, key0, NK, sb, st, sg, D: gl.constexpr, BLOCK_N: gl.constexpr,
               ATOMIC: gl.constexpr, num_warps: gl.constexpr):
    """dK or dV of a key tile: stored in OUT's type, or added (float32) with relaxed atomics where several programs
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


# ---------------------------------------------------------------- work items


@gluon.jit
def item_block(ITEM_KEY, ITEM_START, item, NS, G):
    """(first entry, block j, b * G + g, b (32-bit, for TMA coordinates), b (64-bit, for pointers), g) of an item."""
    key_id = gl.load(ITEM_KEY + item)  # (b * G + g) * NS + j
    bg = key_id // NS
    b32 = bg // G
    return gl.load(ITEM_START + item), key_id % NS, bg, b32, b32.to(gl.int64), bg % G


@gluon.jit
def block_first(BLOCK_START, j, BLOCK_N: gl.constexpr, PACKED: gl.constexpr):
    """The first token of key block j: j * BLOCK_N, or packed, the stream's block table's entry (nsa.ops.packing)."""
    first = j * BLOCK_N
    if PACKED:
        first = gl.load(BLOCK_START + j)
    return first


@gluon.jit
def masked_rows(ENTRIES, start, count, bg, T, k_first, n: gl.constexpr, h: gl.constexpr, BLOCK_N: gl.constexpr,
                layout: gl.constexpr):
    """The item's rows before which the causal mask applies: those of its queries inside the block (fewer than
    BLOCK_N of them, first in the entries, which are sorted by query); every later row sees the whole block."""
    e = gl.arange(0, BLOCK_N, layout=layout)
    t_first = gl.load(ENTRIES + start + e, mask=e < count, other=0) // n - bg * T
    return gl.sum(((e < count) & (t_first < k_first + BLOCK_N - 1)).to(gl.int32), 0) * h


@gluon.jit
def load_block(k_desc, v_desc, bar, k_smem, v_smem, row, col):
    """The item's key and value block by TMA, arriving on bar."""
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_smem)


@gluon.jit
def step_entries(ENTRIES, start, r0, rows, h: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """(row ok, flat entry f) of the item's rows [r0, r0 + BLOCK_M); rows are (entry, head), entry-major."""
    r = r0 + gl.arange(0, BLOCK_M, layout=layout)
    ok = r < rows
    return ok, gl.load(ENTRIES + start + r // h, mask=ok, other=0)


@gluon.jit
def ring_turn(ENTRIES, start, r0, rows, h: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              layout: gl.constexpr):
    """The ring's turn at the row step starting at r0: (first row, row ok, entry) of step s + STAGES - 1, whose
    copies the caller issues next, read before waiting for step s's copies so that their latency hides behind
    the wait; then the wait, and a barrier after which step s - 1's stage is free."""
    nxt_r0 = r0 + (STAGES - 1) * BLOCK_M
    f_ok, f = step_entries(ENTRIES, start, nxt_r0, rows, h, BLOCK_M, layout)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    gl.thread_barrier()
    return nxt_r0, f_ok, f
