"""Building blocks shared by the NSA Triton kernels: @triton.jit helpers (inlined by Triton) and launch helpers.

- tiles: loads and stores of row tiles, the online softmax, a branch's gradient rows;
- span keys: which keys a program's (token, head) rows see in the span kernels (span_attention.py) and the dQ kernel
  of every branch (query_grad.py), and the loops' masked edges and unmasked interior, for one sequence a batch
  row or packed documents (nsa.ops.packing's tables, behind the PACKED flag);
- Eq. 9 and ranking: block overlaps and the running top-K merge of the selection and decode kernels;
- search: a binary search over a sorted array (the inverse index's items);
- launch: tile sizes, widths, the products' precision, the GPU's SM count and PyTorch's deterministic mode.

Grouped-query packing: a program's rows are consecutive (token, head) pairs of one key/value group, row r <->
token r // h, head r % h. Any group size h fills the matrix units without padding, and every loaded key/value tile
serves all h heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

from ..packing import PackedLayout
from ..tuning import TUNING

LOG2E = 1.4426950408889634
"""Kernels work in base 2 (exp2/log2); scores are pre-multiplied by scale * LOG2E."""


# ---------------------------------------------------------------- tiles


@triton.jit
def load_tile(PTR, row_off, d, row_ok, D: tl.constexpr):
    """[rows, len(d)] tile whose row r starts at PTR + row_off[r]; masked rows and columns >= D read 0."""
    return tl.load(PTR + row_off[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def store_tile(PTR, row_off, d, row_ok, value, D: tl.constexpr):
    """Store value [rows, len(d)] where load_tile would read it, in PTR's type."""
    tl.store(PTR + row_off[:, None] + d[None, :], value.to(PTR.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit
def load_grad_rows(DO, LSE, DELTA, do_off, lse_off, dv, row_ok, DV: tl.constexpr):
    """For a branch's backward: (do, the branch's gated lse in log2 units, its delta) of the given rows (see
    gating.gate_grads: the gate is folded into lse and delta, so do is loaded as it is)."""
    do = load_tile(DO, do_off, dv, row_ok, DV)
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    return do, lse2, delta


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, scale_log2, pick, PICK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax update for raw scores s (-inf where masked) over values v; m_i in log2 units. With PICK,
    only the rows where `pick` holds take part (the others' p is 0: exponents against +inf). DOT_PRECISION: the
    precision of the product P.V (dot_precision).

    The scale enters the exponent's FMA (and the row maximum once, scale > 0), and the row choice a per-row
    operand, instead of a multiply and a select over the tile: two instructions fewer per score."""
    row_max = tl.max(s, 1) * scale_log2
    if PICK:
        row_max = tl.where(pick, row_max, float("-inf"))
    m_new = tl.maximum(m_i, row_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    m_exp = tl.where(pick, m_safe, float("inf")) if PICK else m_safe
    p = tl.exp2(s * scale_log2 - m_exp[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


@triton.jit
def softmax_finish(m_i, l_i, acc):
    """(output, lse in natural units); rows that saw no key give 0 and -inf."""
    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    return acc / l_safe[:, None], lse


# ---------------------------------------------------------------- span keys


@triton.jit
def key_range(t, MODE: tl.constexpr, block_len, block_stride, window):
    """First and last key index visible to query token(s) t (last < first means none), for branches.MODE_*."""
    if MODE == 0:
        lo = t * 0
        hi = tl.where(t >= block_len - 1, tl.maximum(t - block_len + 1, 0) // block_stride, -1)
    elif MODE == 1:
        lo = tl.maximum(t - window + 1, 0)
        hi = t
    else:
        lo = t * 0
        hi = t
    return lo, hi


@triton.jit
def document_key_range(p, row_ok, DOC_START, CMP_START, MODE: tl.constexpr, block_len, block_stride, window):
    """Packed documents: first and last key visible to stream position(s) p (int32): key_range at the position in
    the document, moved onto the document's keys (its compressed rows for MODE_CMP, its tokens otherwise). Both
    bounds are non-decreasing in p (a later document's keys follow an earlier one's), so a tile's first and last
    tokens bound every row's, as they do without documents."""
    doc_start = tl.load(DOC_START + p, mask=row_ok, other=0)
    lo, hi = key_range(p - doc_start, MODE, block_len, block_stride, window)
    if MODE == 0:
        base = tl.load(CMP_START + p, mask=row_ok, other=0)
    else:
        base = doc_start
    return lo + base, hi + base


@triton.jit
def chosen_blocks(BITS, off, row_ok):
    """[rows] bit j set where the row's query chose selection block j (MODE_SEL has at most 64 blocks)."""
    return tl.load(BITS + off, mask=row_ok, other=0)


@triton.jit
def picked(bits, kidx, sel_block):
    """[rows, keys]: whether each row chose each key's block (key steps that span blocks; see picked_rows)."""
    return ((bits[:, None] >> (kidx // sel_block)[None, :]) & 1) != 0


@triton.jit
def picked_rows(bits, first_key, sel_block):
    """[rows]: whether each row chose the block holding first_key (ONE_BLOCK: a whole key step lies in one block).

    A choice that is one bit per row is applied per row, not per element: as a +inf log-sum-exp or softmax
    maximum (p = 0), instead of a select over the tile."""
    return ((bits >> (first_key // sel_block)) & 1) != 0


@triton.jit
def picked_in_document(bits, k32, doc_start, sel_block):
    """[rows, keys]: picked for packed documents, whose blocks start at each row's document start (int32 keys and
    starts); keys before it read block 0 (the range masks them). Within a document's visible keys the block is
    below 64 (the tiled path runs while the whole stream has at most 64 blocks); later keys clamp to 63."""
    block = tl.minimum(tl.maximum(k32[None, :] - doc_start[:, None], 0) // sel_block, 63)
    return ((bits[:, None] >> block.to(tl.int64)) & 1) != 0


@triton.jit
def program_rows(pid_m, pid_bg, T, G, h, BLOCK_M: tl.constexpr):
    """(b, g, row ok, token, head) of a program's (token, head) rows; row r <-> token r // h, head r % h."""
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return b, g, rows < T * h, (rows // h).to(tl.int64), (g * h + rows % h).to(tl.int64)


@triton.jit
def interior(first, last, lo, hi, step, ALIGN_HI: tl.constexpr):
    """Split [first, last) (first a multiple of step) at a (>= lo) and e (<= hi + 1) so that the steps of
    [a, e) lie inside [lo, hi]: [first, a) and [e, last) then need masks, [a, e) does not. Three loops without
    branches inside, so Triton can pipeline their loads."""
    a = tl.minimum(tl.maximum(((lo + step - 1) // step) * step, first), last)
    e = tl.maximum(tl.minimum(((hi + 1) // step) * step, ((last // step) * step) if ALIGN_HI else last), a)
    return a, e


@triton.jit
def key_step(K, V, k_base, v_base, skt, svt, NK, start, dk, dv, DK: tl.constexpr, DV: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """Key indices and the K, V tiles of the key step at `start` (keys outside 0..NK-1 read 0)."""
    kidx = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_ok = (kidx >= 0) & (kidx < NK)
    return kidx, load_tile(K, k_base + kidx * skt, dk, k_ok, DK), load_tile(V, v_base + kidx * svt, dv, k_ok, DV)


@triton.jit
def visible(kidx, start, lo, hi, row_ok, chosen, sel_block, MODE: tl.constexpr, ONE_BLOCK: tl.constexpr,
            PACKED: tl.constexpr):
    """[rows, keys]: each row's visible range (lo, hi int32), and for MODE_SEL its choices (unless ONE_BLOCK).

    The compressed range starts at key 0, so one compare (rows past the end get an empty range). The window's
    two bounds stay two compares: as one unsigned compare of hi - key they need more registers (the dQ kernel
    then fits fewer programs per SM and the tiled selected forward spills). PACKED: every range has two bounds
    (a document's compressed rows start at its first row), and MODE_SEL's blocks start at each row's document
    start, which is its lo."""
    k32 = kidx.to(tl.int32)  # 32-bit compares: key indices stay below T
    if MODE == 0 and not PACKED:
        seen = k32[None, :] <= tl.where(row_ok, hi, -1)[:, None]
    else:
        seen = (k32[None, :] >= lo[:, None]) & (k32[None, :] <= hi[:, None]) & row_ok[:, None]
    if MODE == 2 and PACKED:
        seen = seen & picked_in_document(chosen, k32, lo, sel_block)
    elif MODE == 2 and not ONE_BLOCK:  # ONE_BLOCK: the callers apply the choice per row
        seen = seen & picked(chosen, kidx, sel_block)
    return seen


@triton.jit
def key_plan(pid_m, b, g, t, row_ok, T, h, IDX, sib, sit, sig, MODE: tl.constexpr, block_len, block_stride, window,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr, DOC_START, CMP_START):
    """For a tile of query rows: each row's key range, the tile's key steps [k_start, k_end), the rows' choices
    (MODE_SEL), the interior [a, e) of keys every row sees (MODE_SEL masks it by the choices alone), and the first
    key the tile's last row sees.

    PACKED (DOC_START, CMP_START: the layout's per-token tables): the ranges of document_key_range. A tile that
    holds rows of two documents has no interior (the later document's first key follows the earlier one's
    last), so the interior's rows are of one document; for MODE_SEL its keys' blocks start at that last key."""
    if PACKED:
        lo, hi = document_key_range(t.to(tl.int32), row_ok, DOC_START, CMP_START, MODE, block_len, block_stride,
                                    window)
    else:
        lo, hi = key_range(t.to(tl.int32), MODE, block_len, block_stride, window)
    t_first = (pid_m * BLOCK_M) // h
    t_last = tl.minimum(T - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // h)
    # Keys any row sees: from the first token's first to the last token's last (the start aligned to BLOCK_N).
    if PACKED:
        span_lo, full_hi = document_key_range(t_first, t_first < T, DOC_START, CMP_START, MODE, block_len,
                                              block_stride, window)
        full_lo, span_hi = document_key_range(t_last, t_last < T, DOC_START, CMP_START, MODE, block_len,
                                              block_stride, window)
    else:
        span_lo, full_hi = key_range(t_first, MODE, block_len, block_stride, window)
        full_lo, span_hi = key_range(t_last, MODE, block_len, block_stride, window)
    k_start = (span_lo // BLOCK_N) * BLOCK_N
    k_end = span_hi + 1
    if MODE == 2:
        chosen = chosen_blocks(IDX, b * sib + t * sit + g * sig, row_ok)
    else:
        chosen = row_ok.to(tl.int64)
    a, e = interior(k_start, k_end, full_lo, full_hi, BLOCK_N, False)
    return lo, hi, k_start, k_end, chosen, a, e, full_lo


# ---------------------------------------------------------------- Eq. 9 and ranking


@triton.jit
def overlap(tok_start, j, block_len, sel_block, block_stride):
    """|[tok_start, tok_start + l) ∩ [j*l', (j+1)*l')| / d for broadcastable index tensors."""
    lo = tl.maximum(tok_start, j * sel_block)
    hi = tl.minimum(tok_start + block_len, (j + 1) * sel_block)
    return tl.maximum(hi - lo, 0).to(tl.float32) / block_stride


@triton.jit
def merge_top(best, key):
    """The K largest of best (sorted descending) and the chunk's K keys, sorted descending."""
    # Elementwise max of a descending and an ascending list is a bitonic sequence holding the K largest of
    # both (the first half-cleaner of a bitonic merge); one bitonic merge sorts it. Sorting only the new keys
    # and merging costs less than a top-K over both lists.
    return tl.bitonic_merge(tl.maximum(best, tl.sort(key)), descending=True)


# ---------------------------------------------------------------- split softmax (decode)


@triton.jit
def merge_partials(PM, PL, PACC, first, count, h, HP: tl.constexpr, BLOCK_DV: tl.constexpr, PT: tl.constexpr,
                   c0, DVT: tl.constexpr):
    """Merge `count` partial softmaxes (rows first .. first+count-1 of [*, HP] stats and [*, HP, BLOCK_DV]
    sums, of which the first h heads are stored), PT at a time: (max, sum, acc) over all of them, in log2
    units; acc holds the DVT columns from c0 (padding heads: -inf, 0, 0)."""
    rh = tl.arange(0, HP)
    dv = c0 + tl.arange(0, DVT)
    acc = tl.zeros([HP, DVT], tl.float32)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    for p0 in range(0, count, PT):
        pp = p0 + tl.arange(0, PT)
        ok = pp < count
        row = (first + pp).to(tl.int64)[:, None] * HP + rh[None, :]  # [PT, HP]
        ok = ok[:, None] & (rh < h)[None, :]
        m = tl.load(PM + row, mask=ok, other=float("-inf"))
        l_p = tl.load(PL + row, mask=ok, other=0.0)
        a = tl.load(PACC + row[:, :, None] * BLOCK_DV + dv[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        f = tl.exp2(m - m_safe[None, :])  # 0 for empty partials
        l_i = l_i * alpha + tl.sum(l_p * f, 0)
        acc = acc * alpha[:, None] + tl.sum(a * f[:, :, None], 0)
        m_i = m_new
    return m_i, l_i, acc



# ---------------------------------------------------------------- search


@triton.jit
def lower_bound(SORTED, size, key, STEPS: tl.constexpr):
    """First position in SORTED[0:size] holding a value >= key (size if none), for each key; STEPS >= the bit
    length of size."""
    lo = tl.zeros_like(key)
    hi = lo + size
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = lo + (hi - lo) // 2
        v = tl.load(SORTED + mid, mask=active, other=0)
        lo = tl.where(active & (v < key), mid + 1, lo)
        hi = tl.where(active & (v >= key), mid, hi)
    return lo


# ---------------------------------------------------------------- launch


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) of non-negative integers, for launchers. triton.cdiv and triton.next_power_of_2 are constexpr
    functions: each host call goes through their argument unwrapping, tens of them a call of nsa_attention."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """The least power of two >= n (0 for n = 0, as triton.next_power_of_2), for launchers (ceil_div says why)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def tile_sizes(q: torch.Tensor, dk: int, dv: int, kernel: str = "fwd") -> dict:
    """Tile sizes of the span forward ('fwd'), dQ ('dq') or span dK/dV ('dkdv') kernel (query rows x key step;
    dK/dV: row step x keys). Under the CPU interpreter the smallest: there the cost is per program and operation."""
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    if ieee_products(q):
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)
    wide = max(dk, dv) > 64
    if kernel == "dkdv":
        return dict(BLOCK_M=TUNING.dkdv_block_m_wide if wide else TUNING.dkdv_block_m, BLOCK_N=TUNING.dkdv_block_n,
                    num_warps=TUNING.dkdv_warps, num_stages=TUNING.dkdv_stages)
    if kernel == "dq" and not wide:
        return dict(BLOCK_M=TUNING.dq_block_m, BLOCK_N=TUNING.dq_block_n, num_warps=TUNING.dq_warps,
                    num_stages=TUNING.span_stages)
    return dict(BLOCK_M=TUNING.span_block_m_wide if wide else TUNING.span_block_m, BLOCK_N=TUNING.span_block_n,
                num_warps=TUNING.span_warps, num_stages=TUNING.span_stages)


def one_block(mode: int, sel_block: int, block_n: int, layout: PackedLayout | None) -> bool:
    """Whether every MODE_SEL key step lies in one selection block (its choice is then applied per row): key steps
    start at multiples of block_n, and so do blocks of a sequence, not those of packed documents."""
    return mode == 2 and sel_block % block_n == 0 and layout is None


def dot_width(n: int) -> int:
    """The power-of-two tile width that holds n columns (at least 16, tl.dot's least)."""
    return max(16, next_power_of_two(n))


def head_dims(dk: int, dv: int) -> dict:
    """Constexpr head dims and their power-of-two tile widths (at least 16 for tl.dot)."""
    return dict(DK=dk, DV=dv, BLOCK_DK=dot_width(dk), BLOCK_DV=dot_width(dv))


def eager_call(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call may skip its custom op for an autograd.Function over the same stages (less host time a call):
    not traced (torch.compile, export) and on plain tensors (no fake, meta or subclass tensors, which only a custom
    op's fake implementation serves)."""
    return (not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)
            and tensors[0].device.type != "meta")


def dot_precision(dtype: torch.dtype) -> str:
    """The DOT_PRECISION constexpr of the kernels' products (tl.dot's input_precision) on inputs of `dtype`.

    Float32 follows PyTorch's rule for its own float32 matmuls on CUDA: full float32 products ("ieee") unless
    PyTorch allows TF32, then "tf32". The setting is torch.backends.cuda.matmul.fp32_precision (what
    torch.backends.cuda.matmul.allow_tf32 = True, torch.set_float32_matmul_precision("high") and
    torch.backends.fp32_precision = "tf32" set too), or before PyTorch 2.9 allow_tf32. 16-bit inputs get "tf32",
    Triton's default, which their products do not read: their kernels compile as they would without it. Read at
    each launch, so a kernel compiles once per precision."""
    if dtype != torch.float32:
        return "tf32"
    matmul = torch.backends.cuda.matmul
    # Once fp32_precision has been set, reading allow_tf32 raises: it is read only where fp32_precision is absent.
    setting = getattr(matmul, "fp32_precision", None)
    allowed = matmul.allow_tf32 if setting is None else setting == "tf32"
    return "tf32" if allowed else "ieee"


def ieee_products(x: torch.Tensor) -> bool:
    """Whether kernels on x multiply in IEEE float32 on a GPU (float32 inputs, TF32 not allowed). Triton runs those
    products as FMA loops with both operands in registers: at the 16-bit tiles they spill kilobytes a thread, so
    their launches take smaller tiles on 8 warps and one pipeline stage (docs/kernels.md#precision)."""
    return x.is_cuda and dot_precision(x.dtype) == "ieee"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 off CUDA: the interpreter's stand-in, for launch sizing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def deterministic() -> bool:
    """Whether PyTorch's deterministic mode is on (torch.use_deterministic_algorithms; `train.deterministic`): the
    backward kernels then write per-program partial sums that are added in a fixed order, instead of adding them
    into one buffer with float32 atomics, whose order (and so rounding) varies from run to run."""
    return torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def skip_deterministic_fill() -> Iterator[None]:
    """Buffers allocated inside are not filled first. PyTorch's deterministic mode fills every torch.empty with NaN
    (torch.utils.deterministic.fill_uninitialized_memory) so that a read of memory nobody wrote gives the same bits
    each run; the NSA kernels write every element they later use, so for their buffers the fill is pure cost."""
    saved = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = saved
