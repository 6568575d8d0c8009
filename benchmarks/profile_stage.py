"""One NSA forward+backward at the given shape and length, for Nsight Compute to profile selected kernels:

    ncu -k regex:_select_kernel --launch-count 1 --section SpeedOfLight python3 benchmarks/profile_stage.py m7c 65536

With --table DIR: times the forward+backward instead (time_cuda three times, then 20 steps back to back:
wall time and the host's launch time per step) and writes the PyTorch profiler's kernels by time to
DIR/prof_<shape>_<T>_b<batch>.txt, e.g. `python3 benchmarks/profile_stage.py m7c 2048 16 --table out`.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from nsa.bench.attention import HP, SHAPES, _fwd_bwd, _nsa, make_inputs
from nsa.bench.common import profile_to_file, time_cuda
from nsa.ops import nsa_attention

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("shape", choices=sorted(SHAPES))
parser.add_argument("T", type=int)
parser.add_argument("batch", type=int, nargs="?", default=1)
parser.add_argument("--table", metavar="DIR", help="time and write the profiler's kernel table here")
ns = parser.parse_args()
shape, T, batch, table_dir = ns.shape, ns.T, ns.batch, ns.table
H, G, Dk, Dv = SHAPES[shape]
ins = make_inputs(T, H, G, Dk, Dv, batch=batch)
if table_dir is None:
    out = nsa_attention(*ins, **HP)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"profiled one forward+backward: {shape} T={T} batch={batch}")
    sys.exit(0)
step = _fwd_bwd(_nsa(ins), ins)
print(shape, T, batch, "fwd+bwd ms (time_cuda x 3)", [round(time_cuda(step), 4) for _ in range(3)])
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    step()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"wall ms/step {(t2 - t0) / 20 * 1e3:.3f}  host launch ms/step {(t1 - t0) / 20 * 1e3:.3f}")
path = Path(table_dir) / f"prof_{shape}_{T}_b{batch}.txt"
profile_to_file(step, path, repeats=3, rows=25)
print(path.read_text())
