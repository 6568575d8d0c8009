"""The public NSA ops: build the geometry, check the arguments, then run the chosen backend.

`backend="auto"` picks the fastest correct implementation for the inputs' device:
the Triton kernels on CUDA, the pure-PyTorch reference elsewhere. `backend="reference"`
forces the oracle (for debugging a fast path); `backend="triton"` forces the kernels.

The hyper-parameters come as their five keywords (block_len, block_stride, sel_block, n_sel, window) or, instead,
as one `geometry=NSAGeometry(...)`, built and checked once by the caller (the model builds its own).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import reference
from .geometry import NSAGeometry, geometry_from
from .validation import check_nsa_inputs, check_select_inputs

BACKENDS = ("auto", "reference", "triton")


def resolve_backend(backend: str, device: torch.device, seq_len: int) -> str:
    """The implementation `backend` means for inputs on `device` of seq_len tokens: 'triton' or 'reference'.

    Decided without importing triton or any kernel module, so the CPU path runs where triton is not installed.
    """
    from . import triton as triton_backend

    if backend not in BACKENDS:
        raise ValueError(f"unknown NSA backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "reference" or seq_len == 0:
        return "reference"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_backend.installed() else "reference"
    if not triton_backend.available(device):
        raise ConfigError(f"model.nsa.backend=triton needs a CUDA device (got {device}) and the triton package; "
                          "use model.nsa.backend=auto")
    return "triton"


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    block_len: int | None = None,
    block_stride: int | None = None,
    sel_block: int | None = None,
    n_sel: int | None = None,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    geometry: NSAGeometry | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Native Sparse Attention output [B,T,H,Dv] (docs/design.md#public-api).

    q [B,T,H,Dk]; k_cmp/v_cmp [B,Nc,G,D] (already compressed); k_sel, v_sel, k_win,
    v_win [B,T,G,D]; gates [B,T,H,3] in (cmp, sel, win) order, already in [0, 1] (the CUDA backward folds
    each gate into its branch's log-sum-exp as ln g, so a gate <= 0 passes its branch no gradient).
    The geometry is the five keywords or `geometry` (one form, not both). Differentiable in every tensor argument.

    Packed documents: with cu_seqlens (int32 [N+1]), q and the raw keys, values and gates are [1, total, ...],
    k_cmp/v_cmp [1, C, G, D] hold each document's compressed tokens back to back from
    `compressed_offsets(cu_seqlens, geometry)` on, and every document is its own sequence
    (docs/design.md#packed-documents).
    """
    geometry = geometry_from(geometry, block_len=block_len, block_stride=block_stride, sel_block=sel_block,
                             n_sel=n_sel, window=window)
    check_nsa_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, geometry, cu_seqlens)
    if resolve_backend(backend, q.device, q.shape[1]) == "triton":
        from .custom_ops import nsa_attention_kernels

        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return nsa_attention_kernels(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, geometry, scale,
                                     several_documents(cu_seqlens))
    return reference.nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, geometry=geometry,
                                   scale=scale, cu_seqlens=cu_seqlens)


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int | None = None,
    block_stride: int | None = None,
    sel_block: int | None = None,
    n_sel: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    geometry: NSAGeometry | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selected block indices [B,T,G,n] (int64, ascending, unused slots -1); the geometry as four keywords or
    `geometry` (its window unused). With cu_seqlens, the document-relative blocks of each packed document
    (q [1,total,H,Dk], k_cmp as nsa_attention takes it)."""
    geometry = geometry_from(geometry, block_len=block_len, block_stride=block_stride, sel_block=sel_block,
                             n_sel=n_sel)
    check_select_inputs(q, k_cmp, geometry, cu_seqlens)
    if resolve_backend(backend, q.device, q.shape[1]) == "triton":
        from .custom_ops import select_blocks_kernels

        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return select_blocks_kernels(q, k_cmp, geometry, scale, several_documents(cu_seqlens))
    return reference.select_blocks(q, k_cmp, geometry=geometry, scale=scale, cu_seqlens=cu_seqlens)


def several_documents(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """cu_seqlens, or None where it has two entries: one document, [0, total] by the convention, which the
    unpacked kernels (Gluon's included) run at their own speed. Decided from the shape alone, so nothing waits
    for the device and a compiled or captured call keeps one path."""
    return None if cu_seqlens is None or cu_seqlens.shape[0] == 2 else cu_seqlens
