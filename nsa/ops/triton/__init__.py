"""Triton kernels for NSA (one module per kernel family) and their composition into custom ops."""

from __future__ import annotations

import torch


def installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Triton can run NSA on `device`: a CUDA GPU, or any device under Triton's CPU interpreter."""
    return installed() and (device.type == "cuda" or interpreting())


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (decided by Triton when it loads our kernels)."""
    from triton.runtime.interpreter import InterpretedFunction

    from .range_attention import _range_fwd_kernel

    return isinstance(_range_fwd_kernel, InterpretedFunction)
