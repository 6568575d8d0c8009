"""What the H100's DRAM sustains for the selected forward's partial traffic: write-only, read-only and copy of a
buffer the size of the per-slot partials at M7C 32k x 2 (B*G*T*n rows of h = 6 heads x 64 bf16 = 1.61 GB).

    python dram_probe.py   (on the GPU; prints GB/s and ms for 1.61 GB)
"""
import torch

from nsa.bench.common import time_cuda

rows = 2 * 2 * 32768 * 16
x = torch.empty(rows, 6, 64, device="cuda", dtype=torch.bfloat16).normal_()
y = torch.empty_like(x)
nbytes = x.numel() * x.element_size()

for name, fn, moved in (("write (fill)", lambda: y.fill_(1.0), nbytes),
                        ("read (sum)", lambda: x.sum(dtype=torch.float32), nbytes),
                        ("copy (read + write)", lambda: y.copy_(x), 2 * nbytes)):
    ms = time_cuda(fn, queued=True)  # GPU time per call, calls back to back
    print(f"{name:22s} {nbytes / 1e9:.2f} GB buffer  {ms:.3f} ms  {moved / ms / 1e6:.0f} GB/s", flush=True)
