"""The test plumbing's interpreter speed-ups (tests/interpreter_speedups.py) change no result: xor reductions,
sorts and top-k give what NumPy and PyTorch give, and the one-time listing of builtins patches exactly the names
the interpreter's own listing patches."""

import functools
import operator

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from interpreter_speedups import interpreter_speedups  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the speed-ups are for Triton's CPU interpreter")


@triton.jit
def _reductions_kernel(X, BY_COLUMN, BY_ROW, BY_ROW_KEPT, ALL, SORTED, TOP, M: tl.constexpr, N: tl.constexpr,
                       K: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, N)
    x = tl.load(X + rows[:, None] * N + cols[None, :])
    tl.store(BY_COLUMN + cols, tl.xor_sum(x, 0))
    tl.store(BY_ROW + rows, tl.xor_sum(x, 1))
    tl.store(BY_ROW_KEPT + rows[:, None], tl.xor_sum(x, 1, keep_dims=True))
    tl.store(ALL, tl.xor_sum(x))
    tl.store(SORTED + rows[:, None] * N + cols[None, :], tl.sort(x, descending=True))
    tl.store(TOP + rows[:, None] * K + tl.arange(0, K)[None, :], tl.topk(x, K))


def test_xor_reductions_sorts_and_top_k_match_numpy_and_torch():
    interpreter_speedups()  # applied by conftest already: a second call changes nothing
    M, N, K = 4, 16, 4
    x = torch.randint(-2**30, 2**30, (M, N), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    out = dict(by_column=torch.empty(N, dtype=torch.int32), by_row=torch.empty(M, dtype=torch.int32),
               kept=torch.empty(M, dtype=torch.int32), all=torch.empty(1, dtype=torch.int32),
               sorted=torch.empty(M, N, dtype=torch.int32), top=torch.empty(M, K, dtype=torch.int32))
    _reductions_kernel[(1,)](x, *out.values(), M=M, N=N, K=K)
    xs = x.numpy()
    by_column = [functools.reduce(operator.xor, xs[:, j].tolist()) for j in range(N)]
    by_row = [functools.reduce(operator.xor, xs[i].tolist()) for i in range(M)]
    assert out["by_column"].tolist() == by_column and out["by_row"].tolist() == by_row
    assert out["kept"].tolist() == by_row
    assert out["all"].item() == functools.reduce(operator.xor, xs.ravel().tolist())
    assert torch.equal(out["sorted"], x.sort(dim=1, descending=True).values)
    assert torch.equal(out["top"], x.topk(K, dim=1).values)


def test_the_one_time_listing_patches_the_names_the_interpreters_listing_patches():
    from triton.runtime import interpreter

    fast = interpreter._patch_builtin
    assert getattr(fast, "lists_once", False), "conftest did not apply the speed-up"
    for pkg in (tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base):
        patched = {}
        for name, patch in (("interpreter", fast.listing), ("once", fast)):
            scope = interpreter._LangPatchScope()
            patch(pkg, interpreter.interpreter_builder, scope)
            patched[name] = sorted(attr for _, attr, _ in scope._changes)
            scope.restore()
        assert patched["once"] == patched["interpreter"] and patched["once"], pkg
