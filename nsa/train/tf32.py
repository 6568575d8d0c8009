"""TF32 float32 matmuls for the length of a training run, and PyTorch's previous setting after it.

A run on a GPU multiplies its float32 matrices in TF32 (bf16 autocast covers most products; TF32 speeds up the
rest). The setting is process-wide, so a run started from Python (`nsa.train.loop.train`, a benchmark) restores
it when it ends: a caller's later float32 work, e.g. checking generation against a full forward, runs as that
caller configured it, and the Triton kernels, which follow the same setting, too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[None]:
    """Inside: float32 matmuls in TF32 when `device` is a CUDA device (elsewhere nothing changes). After: the
    setting as it was, through the API it is read with (fp32_precision from PyTorch 2.9, allow_tf32 before)."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    before = getattr(matmul, name)
    setattr(matmul, name, "tf32" if name == "fp32_precision" else True)
    try:
        yield
    finally:
        setattr(matmul, name, before)
