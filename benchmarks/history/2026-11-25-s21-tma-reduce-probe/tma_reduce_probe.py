"""Feasibility: a Gluon kernel adds a [64, 64] float32 tile into a [rows, 64] buffer by TMA reduce (sm_90)."""
import sys
sys.path.insert(0, ".")  # run from the repository root
import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _reduce_kernel(dq_desc, R: gl.constexpr, D: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [gl.num_warps(), 1], [1, 0])
    x = gl.full([R, D], 1.0, gl.float32, layout)
    smem = gl.allocate_shared_memory(gl.float32, [R, D], dq_desc.layout)
    smem.store(x)
    fence_async_shared()
    async_reduce_add(dq_desc, [gl.program_id(0) * 48 + 5, 0], smem)  # any row: steps start mid-token
    tma.store_wait(0)


if __name__ == "__main__":
    from benchmarks.offline_compile import compile_gluon, report
    dq = torch.zeros(4096 * 6, 64, dtype=torch.float32)
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32)
    desc = TensorDescriptor.from_tensor(dq, [64, 64], layout)
    c = compile_gluon(_reduce_kernel, {"dq_desc": desc}, {"R": 64, "D": 64}, {}, 4)
    print([l.strip() for l in c.asm["ptx"].splitlines() if "cp." in l])
    print(report(c))
