"""Faster interpretation of Triton kernels on the CPU, with the same results.

Two costs of Triton's interpreter that the kernel tests pay thousands of times a launch:

- Every call of a @triton.jit helper re-patches triton.language, listing each language module's members with
  inspect.getmembers (a dir(), a getattr per name and a sort) to find the builtins. Here the names of each
  language module's builtins are listed once, at import; each patch still checks and patches the current value
  of every such name, as before.
- The interpreter reduces with NumPy where it knows the combine function (sum, max, min, argmin, argmax) and
  otherwise one element at a time in Python. tl.sort and tl.topk (the top-n of the selection and decode kernels)
  reduce with xor at every stage of their sorting network. Here xor reductions go to NumPy too: xor is
  associative and commutative and exact on integers, so every value is the element-wise loop's.

What each saves is in docs/kernels.md (how the kernels are tested); tests/ops/test_interpreter_speedups.py
checks both against the interpreter's own code. Written against the interpreter of Triton 3.x (its _patch_builtin
function and ReduceOps class); where those are absent nothing changes.
"""

from __future__ import annotations

import inspect

import numpy as np


def interpreter_speedups() -> None:
    """Apply both speed-ups (each once; a no-op without Triton or where its interpreter differs)."""
    list_builtins_once()
    vectorize_xor_reductions()


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
