"""Faster interpretation of Triton kernels on the CPU, with the same results.

Costs of Triton's interpreter that the kernel tests pay thousands of times a launch:

- Every call of a @triton.jit helper re-patches triton.language, listing each language module's members with
  inspect.getmembers (a dir(), a getattr per name and a sort) to find the builtins. Here the names of each
  language module's builtins are listed once, at import; each patch still checks and patches the current value
  of every such name, as before.
- The interpreter reduces with NumPy where it knows the combine function (sum, max, min, argmin, argmax) and
  otherwise one element at a time in Python. tl.sort and tl.topk (the top-n of the selection and decode kernels)
  reduce with xor at every stage of their sorting network. Here xor reductions go to NumPy too: xor is
  associative and commutative and exact on integers, so every value is the element-wise loop's.
- Every integer add, sub and mul below 64 bits builds an overflow check (both operands cast to int64, the
  operation again, the bounds, two comparisons) and hands it to device_assert, which returns without reading it
  unless the builder's options ask for debug, and the interpreter's never do. Here the check is not built where
  its verdict would be dropped (everything else, the asserts on the operands' types included, runs as before).
- Every operation's result asks _get_np_dtype for its NumPy type, and that function builds its table of NumPy
  types at each call. Here the table is built once, from the function itself.
- Every tensor's shape is a triton.language tuple, whose tuple_type spells out its name (each field and type)
  when made, though only printing reads it. Here the name is spelled when read: the same string.

What each saves is in docs/kernels.md (how the kernels are tested); tests/ops/test_interpreter_speedups.py
checks each against the interpreter's own code. Written against the interpreter of Triton 3.x (its
_patch_builtin, ReduceOps, _get_np_dtype, the language's binary_op_sanitize_overflow_impl and tuple_type);
where those are absent or differ nothing changes.
"""

from __future__ import annotations

import inspect

import numpy as np


def interpreter_speedups() -> None:
    """Apply every speed-up (each once; a no-op without Triton or where its interpreter differs)."""
    list_builtins_once()
    vectorize_xor_reductions()
    skip_unread_overflow_checks()
    numpy_types_once()
    name_tuple_types_when_read()


def list_builtins_once() -> bool:
    """Replace the interpreter's _patch_builtin by one that lists each module's builtin names once; True where
    the interpreter was patched (now or before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    listing = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if listing is None or patch_attr is None:
        return False
    if getattr(listing, "lists_once", False):
        return True
    # Listed now, before any launch, on the unpatched language: a patch only ever replaces a builtin by a wrapper
    # (no builtin) and a restore puts the builtin back, so these are all the names a patch can find builtin.
    modules = (tl, tl.core, tl.math, tl.core.tensor, getattr(tl.core, "tensor_descriptor_base", None))
    names = {id(pkg): (pkg, [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)])
             for pkg in modules if pkg is not None}

    def patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return listing(pkg, builder, scope)
        for name in known[1]:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.lists_once = True
    patch_builtin.listing = listing
    interpreter._patch_builtin = patch_builtin
    return True


def vectorize_xor_reductions() -> bool:
    """Route the interpreter's xor reductions to numpy.bitwise_xor.reduce; True where the interpreter was patched
    (now or before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(getattr(tl, "standard", None), "_xor_combine", None)
    if reduce_ops is None or xor_combine is None:
        return False
    if getattr(reduce_ops.apply_impl, "vectorized_xor", False):
        return True
    element_wise = reduce_ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn == xor_combine and len(input) == 1:
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype)
        return element_wise(self, input)

    apply_impl.vectorized_xor = True
    apply_impl.element_wise = element_wise
    reduce_ops.apply_impl = apply_impl
    return True


def skip_unread_overflow_checks() -> bool:
    """Leave out the overflow checks of integer operations where device_assert would drop them unread (the
    interpreter's builder, without debug); True where the language was patched (now or before)."""
    try:
        from triton.language.semantic import TritonSemantic
        from triton.runtime import interpreter
    except ImportError:
        return False
    check = getattr(TritonSemantic, "binary_op_sanitize_overflow_impl", None)
    builder_type = getattr(interpreter, "InterpreterBuilder", None)
    if check is None or builder_type is None:
        return False
    if getattr(check, "skips_unread", False):
        return True

    def sanitize_overflow(self, lhs, rhs, binary_op):
        if not isinstance(self.builder, builder_type) or self.builder.options.debug:
            return check(self, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth < 64 and self.builder.options.sanitize_overflow:
            # the original's checks of the operands, made before it builds the verdict
            assert lhs.type.scalar == rhs.type.scalar and lhs.type.scalar.is_int()
        return None

    sanitize_overflow.skips_unread = True
    sanitize_overflow.check = check
    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow
    return True


def numpy_types_once() -> bool:
    """Replace the interpreter's _get_np_dtype by a lookup in the table it builds at every call, built once by
    asking it about every scalar type of triton.language; True where the interpreter was patched (now or
    before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None:
        return False
    if getattr(get, "table", None) is not None:
        return True
    table = {}
    for value in vars(tl.core).values():
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = get(value)
            except KeyError:  # a type the interpreter has no NumPy type for: it keeps raising
                pass

    def numpy_type(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        found = None if isinstance(scalar, tl.pointer_type) else table.get(scalar)  # pointers are not hashable
        return found if found is not None else get(tt_dtype)

    numpy_type.table = table
    numpy_type.original = get
    interpreter._get_np_dtype = numpy_type
    return True


def tuple_type_name(tuple_type) -> str:
    """The name tuple_type.__init__ gives (Triton 3.x)."""
    return "[" + ",".join([f"{k}:{v}" for k, v in zip(tuple_type.fields, tuple_type.types)]) + "]"


def name_tuple_types_when_read() -> bool:
    """Make tuple_type's name a property, spelled when read; True where the language was patched (now or before).
    Only where tuple_type.__init__ sets exactly its types, fields and that name (checked on a probe)."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    cls = getattr(tl.core, "tuple_type", None)
    if cls is None:
        return False
    if isinstance(vars(cls).get("name"), property):
        return True
    probe = cls([tl.int32, tl.float16], ["a", "b"])
    if vars(probe) != {"types": probe.types, "fields": ["a", "b"], "name": tuple_type_name(probe)}:
        return False

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    __init__.original = cls.__init__
    cls.__init__ = __init__
    cls.name = property(tuple_type_name)
    return True
