"""One NSA forward+backward at the given shape and length, for Nsight Compute to profile selected kernels.

    ncu -k regex:_select_kernel --launch-count 1 --section SpeedOfLight python3 benchmarks/profile_stage.py m7c 65536
"""

import sys

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.ops import nsa_attention

shape, T = sys.argv[1], int(sys.argv[2])
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
H, G, Dk, Dv = SHAPES[shape]
ins = make_inputs(T, H, G, Dk, Dv, batch=batch)
out = nsa_attention(*ins, **HP)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print(f"profiled one forward+backward: {shape} T={T} batch={batch}")
