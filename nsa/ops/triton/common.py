"""Small @triton.jit building blocks shared by the NSA kernels (inlined by Triton)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""Kernels work in base 2 (exp2/log2); scores are pre-multiplied by scale * LOG2E."""


@triton.jit
def load_tile(PTR, row_off, d, row_ok, D: tl.constexpr):
    """[rows, len(d)] tile whose row r starts at PTR + row_off[r]; masked rows and columns >= D read 0."""
    return tl.load(PTR + row_off[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def store_tile(PTR, row_off, d, row_ok, value, D: tl.constexpr):
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
def softmax_step(s, v, m_i, l_i, acc, scale_log2, pick, PICK: tl.constexpr):
    """One online-softmax update for raw scores s (-inf where masked) over values v; m_i in log2 units. With PICK,
    only the rows where `pick` holds take part (the others' p is 0: exponents against +inf).

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
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def softmax_finish(m_i, l_i, acc):
    """(output, lse in natural units); rows that saw no key give 0 and -inf."""
    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    return acc / l_safe[:, None], lse


def dot_width(n: int) -> int:
    """The power-of-two tile width that holds n columns (at least 16, tl.dot's least)."""
    return max(16, triton.next_power_of_2(n))


def head_dims(dk: int, dv: int) -> dict:
    """Constexpr head dims and their power-of-two tile widths (at least 16 for tl.dot)."""
    return dict(DK=dk, DV=dv, BLOCK_DK=dot_width(dk), BLOCK_DV=dot_width(dv))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 off CUDA: the interpreter's stand-in, for launch sizing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def deterministic() -> bool:
    """Whether PyTorch's deterministic mode is on (torch.use_deterministic_algorithms; `train.deterministic`): the
    backward kernels then write per-program partial sums that are added in a fixed order, instead of adding them
    into one buffer with float32 atomics, whose order (and so rounding) varies from run to run."""
    return torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def unfilled() -> Iterator[None]:
    """Buffers allocated inside are not filled first. PyTorch's deterministic mode fills every torch.empty with NaN
    (torch.utils.deterministic.fill_uninitialized_memory) so that a read of memory nobody wrote gives the same bits
    each run; the NSA kernels write every element they later use, so the fill is pure cost (H100, M7C, deterministic
    training at 32k x 2: 268,644 tokens/s with it, 284,162 without)."""
    saved = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = saved
