"""Compile the selection kernel for sm_90 without a GPU: registers, shared memory and the SASS instruction mix.

    python benchmarks/offline_compile.py [BLOCK_T] [HEADS] [HEAD_DIM]

Integer arguments are compiled without Triton's divisible-by-16 specialisation, so loads show narrower than
on the GPU; registers and the mix of the arithmetic are what this is for.
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa.ops.triton import selection

block_t = int(sys.argv[1]) if len(sys.argv) > 1 else 16
heads = int(sys.argv[2]) if len(sys.argv) > 2 else 6
dk = int(sys.argv[3]) if len(sys.argv) > 3 else 64
kernel = selection._select_kernel
names = list(kernel.arg_names)
consts = {"DK": dk, "BLOCK_DK": dk, "BLOCK_T": block_t, "HP": triton.next_power_of_2(heads), "K": 16, "C": 64}
sig = {}
for n in names:
    if n in consts:
        sig[n] = "constexpr"
    elif n in ("Q", "KC"):
        sig[n] = "*bf16"
    elif n == "LSE":
        sig[n] = "*fp32"
    elif n == "IDX":
        sig[n] = "*i64"
    elif n == "scale_log2":
        sig[n] = "fp32"
    else:
        sig[n] = "i32"
src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items() if k in names})
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
ptx = ck.asm["ptx"]
import os, subprocess, tempfile
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(ck.asm["cubin"]); f.flush()
    usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
print(" ".join(l.strip() for l in usage.splitlines() if "REG" in l), "shared", ck.metadata.shared)
print("SASS instructions:", len(re.findall(r"/\*[0-9a-f]{4}\*/", sass)), "HMMA:", sass.count("HMMA"), "MUFU.EX2:", sass.count("MUFU.EX2"),
      "SHFL:", sass.count("SHFL"), "BAR:", sass.count("BAR.SYNC"), "STS:", sass.count("STS"), "LDS:", sass.count("LDS"), "FFMA:", sass.count("FFMA"), "LDL/STL:", sass.count("LDL")+sass.count("STL"))
print("mma.sync:", len(re.findall(r"mma.sync", ptx)), "wgmma:", len(re.findall(r"wgmma.mma_async", ptx)),
      "ex2:", len(re.findall(r"ex2.approx", ptx)), "shfl:", len(re.findall(r"shfl.sync", ptx)),
      "bar.sync:", len(re.findall(r"bar.sync", ptx)), "fma.rn.f32:", len(re.findall(r"fma.rn.f32", ptx)))
