"""The precision of the Triton kernels' products: float32 inputs multiply in full float32 ("ieee") unless PyTorch
allows TF32 for float32 matmuls, and 16-bit inputs keep Triton's default. Every tl.dot names its precision, and
every kernel with products is launched with the one its inputs call for (checked in Triton's CPU interpreter,
which records what the kernels are launched with; its products are exact either way)."""

import ast
import importlib
import inspect
import pkgutil
import types

import pytest
import torch

import nsa.ops.triton
from helpers import LaunchSpy, nsa_inputs, tf32_matmuls
from nsa.ops import NSAGeometry, nsa_attention, tuning
from nsa.ops.triton.common import dot_precision
from nsa.ops.triton.compression import phi_mlp_triton
from nsa.ops.triton.decode import decode_attention_triton
from nsa.ops.triton.dense_decode import dense_decode_triton

HP = dict(block_len=8, block_stride=4, sel_block=8, n_sel=3, window=6)


def triton_modules() -> list:
    return [importlib.import_module(f"nsa.ops.triton.{m.name}") for m in pkgutil.iter_modules(nsa.ops.triton.__path__)]


def launched_kernels(module) -> set[str]:
    """Names of the kernels a module launches (`launcher.launch(name, grid, ...)` or `name[grid](...)`), as opposed
    to the jit helpers they inline. The launcher module's own `kernel[grid](...)` names no kernel."""
    if module.__name__.endswith(".launcher"):
        return set()
    names = set()
    for call in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(call, ast.Call):
            continue
        if isinstance(call.func, ast.Subscript) and isinstance(call.func.value, ast.Name):
            names.add(call.func.value.id)
        elif ast.unparse(call.func) == "launcher.launch" and isinstance(call.args[0], ast.Name):
            names.add(call.args[0].id)
    return names


@pytest.mark.parametrize("allow", ["matmul", "global"])
def test_float32_products_are_ieee_unless_pytorch_allows_tf32(allow):
    matmul = torch.backends.cuda.matmul
    before = torch.backends.fp32_precision, matmul.fp32_precision
    with tf32_matmuls(False):  # restores every setting changed here
        assert dot_precision(torch.float32) == "ieee"
        torch.backends.fp32_precision = "none"
        matmul.fp32_precision = "none"  # inherits the global setting
        assert dot_precision(torch.float32) == "ieee"
        if allow == "matmul":
            matmul.fp32_precision = "tf32"
        else:
            torch.backends.fp32_precision = "tf32"
        assert dot_precision(torch.float32) == "tf32"
        for dtype in (torch.bfloat16, torch.float16):  # Triton's default, whatever the flag
            assert dot_precision(dtype) == "tf32"
        matmul.fp32_precision = "ieee"  # the matmul setting's own value wins over the global one, as in PyTorch
        assert dot_precision(torch.float32) == "ieee"
        for dtype in (torch.bfloat16, torch.float16):
            assert dot_precision(dtype) == "tf32"
    with tf32_matmuls(True):
        assert dot_precision(torch.float32) == "tf32"
    assert (torch.backends.fp32_precision, matmul.fp32_precision) == before


@pytest.mark.parametrize("allow_tf32,expected", [(False, "ieee"), (True, "tf32")])
def test_without_fp32_precision_allow_tf32_decides(allow_tf32, expected, monkeypatch):
    # PyTorch before 2.9 has no fp32_precision: its CUDA matmul setting is allow_tf32 alone.
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=allow_tf32))
    assert dot_precision(torch.float32) == expected


def test_every_product_names_its_precision():
    # A tl.dot without input_precision takes Triton's default, TF32 for float32 inputs whatever PyTorch's flag.
    # "ieee" by name: the selection's and decode's products with the overlap weights, exact for any input type.
    dots = 0
    for module in triton_modules():
        for call in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "tl.dot":
                dots += 1
                precision = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("input_precision")
                assert precision in ("DOT_PRECISION", "'ieee'"), f"{module.__name__}, line {call.lineno}: {precision}"
    assert dots > 20


@pytest.fixture
def product_kernels(monkeypatch):
    """A LaunchSpy on every launched kernel that takes DOT_PRECISION, by name."""
    spies = {}
    for module in triton_modules():
        for name in launched_kernels(module):
            if "DOT_PRECISION" in getattr(module, name).arg_names:
                spies[name] = LaunchSpy(getattr(module, name))
                monkeypatch.setattr(module, name, spies[name])
    return spies


def run_every_kernel(dtype, monkeypatch):
    """NSA attention forward and backward on each selected-branch path,
    phi's MLP forward and backward, and an NSA and a dense decode step, at tiny shapes, on inputs of `dtype`."""
    for path in ("tiled", "blocks", "token"):
        with monkeypatch.context() as m:
            for field in ("tiled_max_blocks", "tiled_max_blocks_large_groups", "tiled_max_blocks_forward"):
                m.setattr(tuning.TUNING, field, 10**9 if path == "tiled" else 0)
            m.setattr(tuning.TUNING, "token_min_heads", 1 if path == "token" else 10**9)
            ins = nsa_inputs(1, 13, 4, 2, 8, 8, block_len=8, block_stride=4, dtype=dtype, requires_grad=True)
            out = nsa_attention(*ins, **HP, backend="triton")
            out.backward(torch.randn_like(out))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 1, 8, generator=g).to(dtype).requires_grad_()
    pos, w1, w2 = (torch.randn(*shape, generator=g).to(dtype) for shape in ((8, 8), (16, 64), (8, 16)))
    phi_mlp_triton((x,), ((pos, w1, w2),), 8, 4)[0].sum().backward()
    B, G, h, D, L = 2, 1, 2, 8, 24
    q, gates = torch.randn(B, G * h, D, generator=g).to(dtype), torch.rand(B, G * h, 3, generator=g).to(dtype)
    k_cmp, v_cmp = (torch.randn(B, 5, G, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, L, G, D, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([9, 23])
    selected = torch.empty(B, G, HP["n_sel"], dtype=torch.int64)
    decode_attention_triton(q, gates, k_cmp, v_cmp, (positions - 3).div(4, rounding_mode="floor"), k, v, k, v,
                            positions, geometry=NSAGeometry(**HP), scale=D**-0.5, selected=selected)
    dense_decode_triton(q, k, v, positions, D**-0.5)


# (inputs, TF32 allowed, the precision every kernel must get). float16: Triton's default, which a launch that read
# the type of a float32 buffer instead of the inputs' would miss.
LAUNCHES = [(torch.float32, False, "ieee"), (torch.float32, True, "tf32"), (torch.float16, False, "tf32")]


@pytest.mark.parametrize("dtype,tf32,want", LAUNCHES, ids=["float32", "float32-tf32", "float16"])
def test_every_product_kernel_is_launched_with_its_inputs_precision(dtype, tf32, want, product_kernels, monkeypatch):
    with tf32_matmuls(tf32):
        run_every_kernel(dtype, monkeypatch)
    assert [name for name, spy in product_kernels.items() if not spy.launches] == [], "kernels not exercised"
    for name, spy in product_kernels.items():
        assert {kw["DOT_PRECISION"] for _, kw in spy.launches} == {want}, name
