"""How close the Gluon range forward (nsa/ops/triton/hopper_forward.py) comes to cuDNN on dense work: the window
branch with w = T is dense causal GQA attention, timed against SDPA's flash and cuDNN backends and the Triton range
kernel on the same inputs, checked against float32 SDPA. The first Gluon kernel of this probe (one head per
program, its variants in RESULTS.md, fifteenth session) is in git history at 2832070.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/gluon_probe.py [--T 2048 --batch 16]'
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from nsa.bench.common import time_cuda
from nsa.ops.triton import range_attention as ra
from nsa.ops.triton.tuning import TUNING

CONFIGS = [(64, 3), (64, 4), (64, 2), (128, 3), (128, 2)]
"""(rows, stages) of the Gluon kernel tried at head dim 64."""


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--groups", type=int, default=2)
    ns = p.parse_args()
    B, T, H, G, D = ns.batch, ns.T, ns.heads, ns.groups, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (H, G, G))
    qd = q.transpose(1, 2).contiguous()
    kd, vd = (t.repeat_interleave(H // G, 2).transpose(1, 2).contiguous() for t in (k, v))
    ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), is_causal=True).transpose(1, 2)
    flops = 4 * B * H * T * T / 2 * D

    def report(name, fn):
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = time_cuda(fn, queued=True)
        print(f"{name:36s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel err {err:.2e}", flush=True)

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(1, 2)
        return run

    def window(gluon: bool, rows: int = 64, stages: int = 3):
        def run():
            TUNING.hopper_forward = gluon
            TUNING.hopper_block_m, TUNING.hopper_stages = rows, stages
            return ra.range_attention_fwd(q, k, v, ra.MODE_WIN, D**-0.5, 32, 16, T)[0]
        return run

    print(f"causal GQA forward, B={B} T={T} H={H} G={G} D={D}, bf16, {torch.cuda.get_device_name()}")
    report("SDPA flash", sdpa(SDPBackend.FLASH_ATTENTION))
    report("SDPA cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION))
    report("Triton range kernel, window = T", window(False))
    for rows, stages in CONFIGS:
        report(f"Gluon range kernel, {rows} rows, {stages} stages", window(True, rows, stages))


if __name__ == "__main__":
    main()
