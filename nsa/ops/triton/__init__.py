"""NSA's Triton kernels, one module per kernel family (forward and backward together), with their launchers.

nsa.ops.dispatch decides which of them (or of the Gluon kernels of nsa.ops.gluon) serves each stage, and
nsa.ops.custom_ops composes the stages into PyTorch custom ops. This package's own import needs no triton:
`installed` and `available` answer where triton is absent.
"""

from __future__ import annotations

import torch


def installed() -> bool:
    """Whether the triton package can be imported."""
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

    from .common import load_tile

    return isinstance(load_tile, InterpretedFunction)
