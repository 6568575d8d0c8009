"""Test plumbing: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before any @triton.jit function is created, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
