"""NSA's Gluon kernels for Hopper GPUs (sm_90): five of the Triton kernels written in Triton's explicitly scheduled
dialect (TMA or cp.async loads into shared-memory rings, asynchronous wgmma overlapped with the softmax).

Each module holds one kernel with the Triton kernel's contract, `supports` (the calls it can take) and `launch`;
nsa.ops.dispatch decides when one serves. Gluon has no CPU interpreter: the Triton kernels stay the ones the CPU
tests check against the reference, these are checked against them on the GPU (tests/ops/test_triton_gpu.py) and
compiled for sm_90 without a GPU (tests/ops/test_kernel_builds.py). Their modules import on any machine with triton.
"""
