"""A training run's TF32 setting holds only while it runs (the flag is PyTorch's, settable without a GPU)."""

import pytest
import torch

from nsa.ops.triton.common import dot_precision
from nsa.train.tf32 import tf32_matmuls


def test_tf32_holds_inside_a_run_on_cuda_and_the_callers_setting_returns_after_it_even_on_an_error():
    before = dot_precision(torch.float32)
    assert before == "ieee"  # PyTorch's default: full float32 products
    with pytest.raises(KeyboardInterrupt):
        with tf32_matmuls(torch.device("cuda")):
            assert dot_precision(torch.float32) == "tf32"
            raise KeyboardInterrupt
    assert dot_precision(torch.float32) == before


def test_a_run_off_cuda_leaves_the_setting_alone():
    with tf32_matmuls(torch.device("cpu")):
        assert dot_precision(torch.float32) == "ieee"
