"""nsa.ops.triton.launcher: its key is at least as fine as Triton's specialization, its fast path launches what
JITFunction.run would, and it falls back to Triton's own path where it cannot be sure.

The fast path needs a compiled kernel; on CPU it is driven through stand-ins for the CompiledKernel, the driver and
JITFunction.run, on a real JITFunction object (made directly, so also under the interpreter).
"""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nsa.ops.triton import launcher


def _toy(x_ptr, y_ptr, n, stride, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3, extra=16):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=offs < n) * scale, mask=offs < n)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def toy_kernel() -> JITFunction:
    """A JITFunction (never compiled here) whose `stride` is do_not_specialize."""
    return JITFunction(_toy, do_not_specialize=["stride"])


X = torch.zeros(64, dtype=torch.float32)


def key(*args, kernel=None, device=0, **kwargs):
    kernel = kernel or KERNEL
    return launcher._key(launcher._launcher_of(kernel), device, args, kwargs)[0]


KERNEL = toy_kernel()


def base(**changes):
    """The toy's arguments with some of them changed (by name)."""
    args = dict(x_ptr=X, y_ptr=X, n=32, stride=3, scale=0.5, flag=True, BLOCK=16)
    args.update(changes)
    return args


def key_of(num_warps=4, **changes):
    return key(**base(**changes), num_warps=num_warps)


@pytest.mark.parametrize("name, a, b", [
    ("n", 1, 2),  # 1 becomes a constexpr
    ("n", 16, 17),  # divisibility by 16
    ("n", 2**31, 5),  # i64 against i32
    ("n", 2**63, 2**62),  # u64 against i64
    ("n", -2**31 - 1, -2**31),  # i64 against i32 (the low edge)
    ("stride", 2**31, 5),  # do_not_specialize keeps the type class
    ("x_ptr", X, X.to(torch.bfloat16)),  # dtype
    ("x_ptr", torch.zeros(64, dtype=torch.int8), torch.zeros(64, dtype=torch.int8)[1:]),  # 16-byte alignment
    ("y_ptr", torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)[1:]),
    ("x_ptr", X, None),  # None is a constexpr
    ("scale", 0.5, 2),  # float against int
    ("flag", True, 1),  # bool against int
    ("BLOCK", 16, 32),  # constexpr values
    ("BLOCK", 1, True),  # equal, but Triton prints them differently
    ("MODE", 0.0, -0.0),
    ("extra", 16, 1),  # a non-constexpr default
])
def test_key_differs_where_triton_specializes_differently(name, a, b):
    assert key_of(**{name: a}) != key_of(**{name: b})


SAMPLES = [0, 1, 2, 15, 16, 17, 48, -1, -16, -17, 2**31 - 16, 2**31, 2**31 + 1, -2**31, -2**31 - 16, 2**63 - 1, 2**63,
           2**64 - 16, 0.0, 1.0, -0.5, True, False, None, X, X[1:], X[4:], X.to(torch.bfloat16), X.to(torch.int8)[1:],
           torch.zeros(3, dtype=torch.int64), torch.nn.Parameter(torch.zeros(8))]


@pytest.mark.parametrize("specialize", [True, False])
def test_key_is_finer_than_tritons_own_specialization(specialize):
    # Triton's specializer itself (C++, no GPU needed): values with one key must get one specialization.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    key_of_value = launcher._arg_key if specialize else launcher._arg_key_unspecialized
    by_key = {}
    for v in SAMPLES:
        spec = native_specialize_impl(BaseBackend, v, False, specialize, True)
        assert by_key.setdefault(key_of_value(v), spec) == spec, v


@pytest.mark.parametrize("v", SAMPLES, ids=range(len(SAMPLES)))
def test_the_binders_inlined_keys_equal_the_reference_ones(v):
    bound = launcher._launcher_of(KERNEL).bind(**base(n=v, stride=v))[1]
    names = [p.name for p in KERNEL.params]
    assert bound[names.index("n")] == launcher._arg_key(v)
    assert bound[names.index("stride")] == launcher._arg_key_unspecialized(v)


def test_key_differs_on_launch_options_and_device():
    assert key_of(num_warps=4) != key_of(num_warps=8)
    assert key(**base(), num_warps=4) != key(**base(), num_warps=4, num_stages=2)
    assert key(**base(), num_warps=4, device=0) != key(**base(), num_warps=4, device=1)


@pytest.mark.parametrize("name, a, b", [
    ("n", 32, 48),  # both divisible by 16, neither 1
    ("n", 5, 7),
    ("stride", 1, 32),  # do_not_specialize: only the class counts
    ("scale", 0.5, 3.0),  # floats are not specialized
    ("flag", True, False),
    ("x_ptr", X, torch.ones(16)),  # the same dtype and alignment
])
def test_key_equal_where_only_unspecialized_values_differ(name, a, b):
    assert key_of(**{name: a}) == key_of(**{name: b})


def test_positional_keyword_and_default_spellings_bind_alike():
    args = base()
    positional = key(*args.values(), num_warps=4)
    assert positional == key(**args, num_warps=4) == key(**args, MODE=3, extra=16, num_warps=4)


def test_arguments_it_cannot_key_take_tritons_path():
    for odd in ((1, 2), object(), 2**64):
        assert launcher._key(launcher._launcher_of(KERNEL), 0, (), base(n=odd)) is None
    assert launcher._key(launcher._launcher_of(KERNEL), 0, (), {"x_ptr": X}) is None  # missing arguments


# --- the fast path, on stand-ins -------------------------------------------------------------------------------


class FakeCompiled:
    """Stands in for a CompiledKernel after its first launch: records what its launcher is run with."""

    def __init__(self):
        self.function, self.packed_metadata, self.runs = "cufunction", ("packed",), []

    def run(self, *args):
        self.runs.append(args)


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake():
    """A fresh toy kernel whose Triton path (JITFunction.run) is recorded and returns a new FakeCompiled."""
    kernel = toy_kernel()
    slow = []

    def run(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return FakeCompiled()

    kernel.run = run
    saved = driver._active
    driver._active = FakeDriver()
    try:
        yield kernel, slow
    finally:
        driver._active = saved
        launcher._launchers.pop(id(kernel), None)


def test_second_launch_runs_the_kept_kernel_as_jit_would(fake):
    kernel, slow = fake
    y = torch.zeros(64)
    first = launcher.launch(kernel, (4,), X, y, 32, 3, 0.5, True, BLOCK=16, num_warps=4)
    assert len(slow) == 1 and slow[0][0] == (4,) and first.runs == []
    second = launcher.launch(kernel, (4,), X, y, 48, 5, 2.0, False, BLOCK=16, num_warps=4)
    assert second is first and len(slow) == 1
    assert first.runs == [(4, 1, 1, 1000, "cufunction", ("packed",), None, None, None,
                           X, y, 48, 5, 2.0, False, 16, 3, 16)]
    launcher.launch(kernel, (2, 3, 5), X, y, 48, 5, 2.0, False, BLOCK=16, MODE=1, extra=7, num_warps=4)
    assert len(slow) == 2  # MODE and extra's divisibility differ: a new key
    kept = launcher.launch(kernel, (2, 3, 5), X, y, 48, 5, 2.0, False, BLOCK=16, MODE=1, extra=7, num_warps=4)
    assert kept.runs == [(2, 3, 5, 1000, "cufunction", ("packed",), None, None, None,
                          X, y, 48, 5, 2.0, False, 16, 1, 7)]


@pytest.mark.parametrize("change", [dict(n=1), dict(n=17), dict(BLOCK=32), dict(num_warps=8),
                                    dict(x_ptr=torch.zeros(64, dtype=torch.int8)[1:])])
def test_a_different_key_takes_tritons_path(fake, change):
    kernel, slow = fake
    launcher.launch(kernel, (4,), **base(), num_warps=4)
    launcher.launch(kernel, (4,), **base(), num_warps=4)
    assert len(slow) == 1
    args = base(**{k: v for k, v in change.items() if k != "num_warps"})
    launcher.launch(kernel, (4,), **args, num_warps=change.get("num_warps", 4))
    assert len(slow) == 2


def test_hooks_switch_and_grid_functions_take_tritons_path(fake):
    kernel, slow = fake
    launcher.launch(kernel, (4,), **base())
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher.launch(kernel, (4,), **base())
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    with launcher.disabled():
        launcher.launch(kernel, (4,), **base())
    launcher.launch(kernel, lambda meta: (4,), **base())
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher.launch(kernel, (4,), **base())
    assert len(slow) == 5
    kernel.pre_run_hooks.clear()
    launcher.launch(kernel, (4,), **base())
    assert len(slow) == 5  # and the fast path again


def test_observer_is_told_of_each_path(fake):
    kernel, _ = fake
    seen = []
    with launcher.observed(lambda k, fast, seconds: seen.append((k, fast, seconds >= 0))):
        launcher.launch(kernel, (4,), **base())
        launcher.launch(kernel, (4,), **base())
    launcher.launch(kernel, (4,), **base())
    assert seen == [(kernel, False, True), (kernel, True, True)]


def test_under_torch_compile_the_launch_is_tritons_own_call(fake, monkeypatch):
    # Dynamo traces `kernel[grid](...)` as a user-defined Triton kernel, not this module's caches.
    kernel, slow = fake
    launcher.launch(kernel, (4,), **base())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    launcher.launch(kernel, (4,), **base())
    assert len(slow) == 2


def test_changed_globals_raise_as_triton_does(fake):
    kernel, _ = fake
    launcher.launch(kernel, (4,), **base())
    kernel.used_global_vals[("LIMIT", 0)] = (1, {"LIMIT": 2})
    with pytest.raises(RuntimeError, match="Global variable LIMIT has changed"):
        launcher.launch(kernel, (4,), **base())


# --- the real thing: the interpreter (CPU) or a compiled kernel (GPU) ------------------------------------------


def test_launch_equals_a_direct_launch():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(100, device=device)
    direct, routed = torch.empty_like(x), torch.empty_like(x)
    _scale_kernel[(4,)](x, direct, 100, 1.5, BLOCK=32)
    for _ in range(2):  # the second takes the fast path where there is one
        routed.zero_()
        launcher.launch(_scale_kernel, (4,), x, routed, 100, 1.5, BLOCK=32)
        assert torch.equal(routed, direct)
    if device == "cpu":
        assert launcher._launcher_of(_scale_kernel) is None  # the interpreter's kernels take Triton's path


def test_every_triton_kernel_of_the_package_launches_through_the_launcher():
    # A `kernel[grid](...)` call in nsa/ops/triton pays Triton's full host cost at every eager launch.
    import re
    from pathlib import Path

    folder = Path(launcher.__file__).parent
    direct = [f"{path.name}:{number}" for path in sorted(folder.glob("*.py")) if path.name != "launcher.py"
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"\b_\w+_kernel\[", line)]
    assert not direct, f"launched without nsa.ops.triton.launcher.launch: {direct}"
