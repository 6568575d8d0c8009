"""Test plumbing: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before any @triton.jit function is created, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from interpreter_speedups import interpreter_speedups

    interpreter_speedups()


def pytest_configure(config):
    """Under pytest-xdist, one intra-op thread per worker: the workers already fill the cores, and more threads
    than cores slow the many small operations of the tests down."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
