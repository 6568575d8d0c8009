"""The test plumbing's interpreter speed-ups (tests/interpreter_speedups.py) change no result: xor reductions,
sorts and top-k give what NumPy and PyTorch give; the one-time listing of builtins patches exactly the names
the interpreter's own listing patches; integer operations give the same values with the overflow checks left
out, which the interpreter builds only to drop; the NumPy types are the interpreter's own; tuple types read the
names they were given when made."""

import dataclasses
import functools
import operator

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from interpreter_speedups import interpreter_speedups, tuple_type_name  # noqa: E402

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


@triton.jit
def _integer_ops_kernel(X, Y, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    x, y = tl.load(X + i), tl.load(Y + i)
    tl.store(OUT + i, x + y)
    tl.store(OUT + N + i, x - y)
    tl.store(OUT + 2 * N + i, x * y)


def _integer_ops(x, y):
    out = torch.empty(3, len(x), dtype=torch.int32)
    _integer_ops_kernel[(1,)](x, y, out, N=len(x))
    return out


def test_integer_operations_leave_out_only_the_overflow_checks_device_assert_drops(monkeypatch):
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    fast = TritonSemantic.binary_op_sanitize_overflow_impl
    assert getattr(fast, "skips_unread", False), "conftest did not apply the speed-up"
    x = torch.tensor([2**31 - 1, -2**31, 7, 46341], dtype=torch.int32)
    y = torch.tensor([1, 1, -3, 46341], dtype=torch.int32)  # the sum, the difference and the product overflow
    exact = torch.stack([x.long() + y.long(), x.long() - y.long(), x.long() * y.long()])
    wrapped = ((exact + 2**31) % 2**32 - 2**31).int()  # int32 arithmetic's two's complement
    verdicts = []
    device_assert = TritonSemantic.device_assert

    def spy(self, cond, msg, mask):
        verdicts.append((msg, device_assert(self, cond, msg, mask)))
        return verdicts[-1][1]

    monkeypatch.setattr(TritonSemantic, "device_assert", spy)
    assert torch.equal(_integer_ops(x, y), wrapped) and verdicts == []  # no check built
    monkeypatch.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl", fast.check)
    assert torch.equal(_integer_ops(x, y), wrapped)  # the interpreter's own: the same values
    assert verdicts and all("overflow detected" in msg and out is None for msg, out in verdicts)  # built, dropped
    # With debug on (the interpreter's options never ask for it) the speed-up runs the check, which then stops.
    monkeypatch.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl", fast)
    debug = dataclasses.replace(interpreter.interpreter_builder.options, debug=True)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", debug)
    with pytest.raises(Exception, match="int32 overflow detected for operation add"):
        _integer_ops(x, y)


def test_the_numpy_types_are_those_the_interpreter_gives():
    from triton.runtime import interpreter

    fast = interpreter._get_np_dtype
    assert getattr(fast, "table", None), "conftest did not apply the speed-up"
    scalars = [v for v in vars(tl.core).values()
               if isinstance(v, tl.dtype) and not isinstance(v, (tl.pointer_type, tl.block_type))]
    pointers = [tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.int64), [4])]
    for ty in scalars + pointers + [tl.block_type(s, [2, 8]) for s in scalars]:
        try:
            want = fast.original(ty)
        except KeyError:  # e.g. void: the speed-up raises as well
            with pytest.raises(KeyError):
                fast(ty)
        else:
            assert fast(ty) == want, ty
    assert {tl.int1, tl.int32, tl.bfloat16, tl.float32} <= set(fast.table)


def test_tuple_types_read_the_names_they_are_given_when_made():
    cls = tl.core.tuple_type
    assert isinstance(vars(cls).get("name"), property), "conftest did not apply the speed-up"

    class Named(cls):
        name = None  # a plain attribute: the interpreter's __init__ stores its name

    shape = tl.core.tuple([tl.constexpr(16), tl.constexpr(8)]).type  # a tensor's shape's type
    for types, fields in ((shape.types, None), ([tl.float16, tl.block_type(tl.int64, [4])], ["a", "b"])):
        made = Named.__new__(Named)
        cls.__init__.original(made, types, fields)
        read = cls(types, fields)
        assert (read.name, str(read), read.types, read.fields) == (made.name, str(made), made.types, made.fields)
        assert read.name == tuple_type_name(made) and read.name.startswith("[")
