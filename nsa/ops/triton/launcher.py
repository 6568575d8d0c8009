"""Launching compiled Triton kernels with less host time than `kernel[grid](...)`.

`launch(kernel, grid, *args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does. Triton's own path
(JITFunction.run) spends tens of microseconds of host time a launch: it queries device and stream, specializes every
argument in C++, builds a string cache key, looks the compiled kernel up, checks the kernel's globals, builds the
launch metadata and only then calls the compiled kernel's launcher. Here the first launch of each specialization
goes through `kernel[grid](...)` and keeps the CompiledKernel it returns; later launches with the same key call its
launcher directly.

The key is a tuple that is at least as fine as Triton's specialization (see `_arg_key`), so a kept kernel is only
reused where Triton would have picked the same one. Whenever that cannot be assured cheaply (the interpreter, a
kernel that is not a plain JITFunction, a grid function, launch or pre-run hooks, an argument of an unknown type,
Triton internals that differ from the ones this was written against), the launch takes Triton's own path.

Wrappers of JITFunction.run (profilers) see only each key's first launch here: `observed` tells of every launch.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from typing import Any, Callable, Iterator

import torch

try:  # this package's import needs no triton (see nsa.ops.triton.installed)
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITCallable, JITFunction
except ImportError:  # pragma: no cover - exercised only without triton
    knobs = HookChain = _driver = JITCallable = JITFunction = None

Observer = Callable[[Any, bool, float], None]
"""Told of every launch: (the kernel, whether it took the fast path, host seconds of the launch)."""

_enabled = True
_observer: Observer | None = None
# id(kernel) -> its _KernelLauncher. Kernels are module-level objects that live as long as the process; the entry holds
# the kernel, so its id is not reused while the entry is kept. Kernels that take Triton's path get no entry.
_launchers: dict[int, _KernelLauncher] = {}


class _Uncacheable(Exception):
    """An argument whose specialization the key cannot mirror: the launch takes Triton's path."""


_TENSOR = torch.Tensor
_PLAIN_CONSTEXPR = frozenset((int, str))  # equal values of these types print alike (Triton keys on str(value))
_INT32_MIN, _INT32_END = -2**31, 2**31
_INT64_MIN, _INT64_END, _UINT64_END = -2**63, 2**63, 2**64


def _int_class(v: int) -> int:
    """Triton's integer type of a Python int: 0 i32, 1 i64, 2 u64 (what native_specialize_impl picks)."""
    if _INT32_MIN <= v < _INT32_END:
        return 0
    if _INT64_MIN <= v < _INT64_END:
        return 1
    if 0 <= v < _UINT64_END:
        return 2
    raise _Uncacheable  # Triton refuses it ("integer to be specialized too large"): let it say so


def _int_key(v: int) -> int:
    """An int's key: -1 for the value 1 (a constexpr to Triton), else 2 * (class + 1) + (16 divides v), i.e.
    2 or 3 for i32, 4 or 5 for i64, 6 or 7 for u64. _make_binder inlines the i32 case."""
    return -1 if v == 1 else 2 * (_int_class(v) + 1) + (not v & 15)


def _int_key_unspecialized(v: int) -> int:
    """A do_not_specialize int's key: Triton keeps only its class, 1 (i32), 2 (i64) or 3 (u64)."""
    return _int_class(v) + 1


def _tensor_key(v: Any) -> tuple:
    """A tensor's key: its dtype and whether data_ptr() is a multiple of 16. _make_binder inlines it."""
    return v.dtype, not v.data_ptr() & 15


def _arg_key(v: Any) -> Any:
    """The key of a specialized (non-constexpr) argument; finer than or equal to Triton 3.6's specialization.

    Triton specializes a tensor on its dtype and on data_ptr() % 16 == 0, an int on its type class (i32, i64, u64),
    on == 1 (then it becomes a constexpr) and on % 16 == 0, a float, bool or None on its type only. Types are matched
    exactly (a bool is an int, a numpy float64 is a float to isinstance): anything else is _Uncacheable.
    """
    t = type(v)
    if t is _TENSOR:
        return _tensor_key(v)
    if t is int:
        return _int_key(v)
    if t is float or t is bool or v is None:
        return t
    if isinstance(v, _TENSOR):  # subclasses (nn.Parameter): Triton reads the same two properties
        return t, _tensor_key(v)
    raise _Uncacheable


def _arg_key_unspecialized(v: Any) -> Any:
    """The key of a do_not_specialize argument: Triton keeps only its type (for an int, i32 / i64 / u64); a
    tensor's key keeps its alignment too (finer than Triton's, which is allowed)."""
    return _int_key_unspecialized(v) if type(v) is int else _arg_key(v)


def _const_key(v: Any) -> Any:
    """The key of a constexpr value of a type outside _PLAIN_CONSTEXPR. Triton keys on str(specialization), so values
    that are equal but print differently (True and 1, 0.0 and -0.0) must get different keys: type and repr for
    floats, the type with the value otherwise, a jit function by its cache_key (it changes with its source)."""
    t = type(v)
    if t is float:
        return t, repr(v)
    if t is tuple:
        return t, tuple(w if type(w) in _PLAIN_CONSTEXPR else _const_key(w) for w in v)
    if isinstance(v, JITCallable):
        return JITCallable, v.cache_key
    return t, v


# The key expressions of one argument `a`, inlined into the binder (a function call per argument would cost more
# than the rest of the launch): tensors and i32 ints inline, anything else through _arg_key and friends, which they
# must equal.
_SPECIALIZED = ("((a.dtype, not a.data_ptr() & 15) if type(a) is _T else "
                "(-1 if a == 1 else 2 + (not a & 15) if -2147483648 <= a < 2147483648 else _int_key(a)) "
                "if type(a) is int else _arg_key(a))")
_UNSPECIALIZED = ("((a.dtype, not a.data_ptr() & 15) if type(a) is _T else "
                  "(1 if -2147483648 <= a < 2147483648 else _int_key_unspecialized(a)) "
                  "if type(a) is int else _arg_key(a))")
_CONSTEXPR = "(a if type(a) in _plain else _const_key(a))"


def _key_expression(kp: Any, name: str) -> str:
    """The Python expression of the key of parameter `kp`'s value, held in the variable `name`."""
    template = _CONSTEXPR if kp.is_constexpr else _UNSPECIALIZED if kp.do_not_specialize else _SPECIALIZED
    return re.sub(r"\ba\b", name, template)


def _make_binder(kernel: Any) -> Callable[..., tuple[tuple, tuple, dict]]:
    """A function with the kernel's signature that returns (argument values in parameter order, defaults
    included; their key; the remaining keyword arguments, i.e. the launch options). Generated once per kernel, as
    Triton's own binder is (create_function_from_signature): Python's call binding does the work."""
    params = list(kernel.signature.parameters.values())
    names = [p.name for p in params]
    keys = [_key_expression(kp, name) for kp, name in zip(kernel.params, names)]
    signature = [n if p.default is inspect.Parameter.empty else f"{n}=_default_{n}" for n, p in zip(names, params)]
    source = (f"def bind({', '.join(signature + ['**options'])}):\n"
              f"    return ({''.join(n + ', ' for n in names)}), ({''.join(k + ', ' for k in keys)}), options\n")
    namespace: dict[str, Any] = {f"_default_{p.name}": p.default for p in params
                                 if p.default is not inspect.Parameter.empty}
    namespace.update(_T=_TENSOR, _plain=_PLAIN_CONSTEXPR, _const_key=_const_key, _arg_key=_arg_key,
                     _int_key=_int_key, _int_key_unspecialized=_int_key_unspecialized)
    exec(source, namespace)  # noqa: S102 - the source is built from the kernel's parameter names only
    return namespace["bind"]


class _KernelLauncher:
    """One kernel's binder and its compiled kernels by key, as (CompiledKernel, its launcher `run`, its function
    handle, its packed metadata): what JITFunction.run reads of it at each launch, read once."""

    __slots__ = ("kernel", "bind", "compiled")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.bind = _make_binder(kernel)
        self.compiled: dict[tuple, tuple] = {}


# What JITFunction.run reads of the kernel on its way to the launch; a kernel object without all of them comes from
# a Triton whose internals differ, and always takes Triton's path.
_JIT_ATTRIBUTES = ("signature", "params", "used_global_vals", "pre_run_hooks", "debug", "device_caches", "fn")


def _launcher_of(kernel: Any) -> _KernelLauncher | None:
    """The kernel's _KernelLauncher, made on first sight; None for a kernel that always takes Triton's path: not
    exactly a JITFunction (the interpreter's InterpretedFunction, autotuners, Gluon kernels, test stand-ins)."""
    launcher = _launchers.get(id(kernel))
    if launcher is not None or type(kernel) is not JITFunction:
        return launcher
    if not (all(hasattr(kernel, a) for a in _JIT_ATTRIBUTES)
            and all(hasattr(kp, "is_constexpr") and hasattr(kp, "do_not_specialize") for kp in kernel.params)):
        return None
    launcher = _launchers[id(kernel)] = _KernelLauncher(kernel)
    return launcher


def _hooks_idle() -> bool:
    """Whether no launch hook is set: then the compiled launcher's hook calls and the launch metadata (read by those
    hooks only) are no-ops, and may be left out. A profiler's hooks make every launch take Triton's path."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (type(hook) is not HookChain or hook.calls):
            return False
    return True


def _key(launcher: _KernelLauncher, device: int, args: tuple, kwargs: dict) -> tuple[tuple, tuple] | None:
    """(the key of this launch, the argument values in parameter order), or None where the key cannot be had
    (an argument of an unknown type, or a call Triton would reject: its own path then raises the error)."""
    try:
        values, arg_keys, options = launcher.bind(*args, **kwargs)
    except (_Uncacheable, TypeError):
        return None
    # Triton's options are the remaining keywords plus debug (kernel.debug or the TRITON_DEBUG knob) and the
    # instrumentation mode, all printed into its key: keep the types, since 4 == 4.0 and True == 1.
    key = (device, arg_keys, tuple(options.items()), tuple(map(type, options.values())), launcher.kernel.debug,
           knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    return key, values


def _globals_unchanged(kernel: Any) -> None:
    """JITFunction.run's check that the globals the kernel was compiled with still hold, with its error."""
    missing = object()
    for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
        if (new := globals_dict.get(name, missing)) != val:
            raise RuntimeError(f"Global variable {name} has changed since we compiled this kernel, from {val} to {new}")


def _slow(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
    """Triton's own launch; returns the CompiledKernel (resolving an asynchronous compile's future as jit.py does)."""
    compiled = kernel[grid](*args, **kwargs)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    return compiled


def _launch(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """(the CompiledKernel, whether the fast path launched it)."""
    launcher = _launcher_of(kernel) if _enabled else None
    if launcher is None or type(grid) is not tuple or kernel.pre_run_hooks or not _hooks_idle():
        return _slow(kernel, grid, args, kwargs), False
    drv = _driver.active
    device = drv.get_current_device()
    keyed = _key(launcher, device, args, kwargs)
    if keyed is None:
        return _slow(kernel, grid, args, kwargs), False
    key, values = keyed
    try:
        entry = launcher.compiled.get(key)
    except TypeError:  # an unhashable constexpr or option value
        return _slow(kernel, grid, args, kwargs), False
    if entry is None:
        compiled = _slow(kernel, grid, args, kwargs)
        # After a launch the handles are loaded: compiled.run is the launcher, compiled.function the CUfunction.
        if compiled is not None and getattr(compiled, "function", None) is not None:
            launcher.compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
        return compiled, False
    compiled, run, function, packed_metadata = entry
    _globals_unchanged(kernel)
    n = len(grid)
    # As JITFunction.run: the grid padded to three dimensions, the current stream of the current device, and every
    # argument value in parameter order (constexprs and defaults too: the compiled launcher skips the constexprs).
    # No hooks are set (checked above), so the launch metadata and both hooks are None: the calls they stand for
    # would do nothing.
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device), function,
        packed_metadata, None, None, None, *values)
    return compiled, True


def launch(kernel: Any, grid: tuple | Callable, *args: Any, **kwargs: Any) -> Any:
    """`kernel[grid](*args, **kwargs)` with less host time once the kernel has been launched with the same
    specialization; returns the CompiledKernel as Triton does. kwargs are constexprs and launch options
    (num_warps, num_stages, ...), as Triton takes them. Under torch.compile the launch is Triton's own call, which
    Dynamo traces as a user-defined Triton kernel (the compiled decode step); it would not trace this module's
    caches."""
    if torch.compiler.is_compiling():
        return kernel[grid](*args, **kwargs)
    if _observer is None:
        return _launch(kernel, grid, args, kwargs)[0]
    start = time.perf_counter()
    compiled, fast = _launch(kernel, grid, args, kwargs)
    _observer(kernel, fast, time.perf_counter() - start)
    return compiled


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside, every launch takes Triton's own path (for comparisons; the kept kernels stay for later)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[None]:
    """Inside, `observer(kernel, fast, seconds)` is told of every launch through `launch` (for host profiles)."""
    global _observer
    saved, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = saved
