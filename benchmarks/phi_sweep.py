"""phi's MLP on one key set at a training shape (the model runs keys and values as two sets of one launch): the compiled PyTorch module against the Triton kernels
(nsa/ops/triton/compression.py) under a few launch settings. Kernel time per call (the profiler's sum over
its kernels: launch-bound calls at this size would otherwise time the host), forward and forward+backward, as
in training: fp32 weights under bf16 autocast.

    python3 benchmarks/phi_sweep.py [--batch 32] [--length 2048] [--block-m 32,64,128] [--warps 4,8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch.profiler import ProfilerActivity, profile

from nsa.model.compression import BlockCompressor
from nsa.ops.triton.tuning import TUNING


def kernel_ms(fn, calls: int = 10, show: bool = False) -> float:
    """Kernel time per call of fn, summed over its kernels (after three warm-up calls); `show` prints them."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if show:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--block-m", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--w1-rows", default="1024")
    ap.add_argument("--kernels", action="store_true", help="print each variant's kernels (forward+backward)")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.length, 3, 2, 64, device="cuda", dtype=torch.bfloat16)[:, :, 0]
    x.requires_grad_()
    ref = BlockCompressor(64, 32, 16, "mlp", 128, backend="reference").cuda()
    fast = BlockCompressor(64, 32, 16, "mlp", 128, backend="triton").cuda()
    fast.load_state_dict(ref.state_dict())
    dy = torch.randn(args.batch, (args.length - 32) // 16 + 1, 2, 64, device="cuda", dtype=torch.bfloat16)

    def timed(module):
        def fwd():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return module(x)

        def fwd_bwd():
            fwd().backward(dy)

        return kernel_ms(fwd), kernel_ms(fwd_bwd, show=args.kernels)

    rows = [("torch compiled", *timed(torch.compile(ref)))]
    for block_m, warps, w1_rows in itertools.product(*(map(int, a.split(",")) for a in
                                                       (args.block_m, args.warps, args.w1_rows))):
        TUNING.phi_block_m, TUNING.phi_warps, TUNING.phi_w1_rows = block_m, warps, w1_rows
        rows.append((f"triton m{block_m} w{warps} r{w1_rows}", *timed(fast)))
    print(f"phi, one key set, {args.batch} x {args.length}, kernel ms per call")
    print(f"{'variant':<28} {'fwd':>8} {'fwd+bwd':>8}")
    for name, f, fb in rows:
        print(f"{name:<28} {f:8.4f} {fb:8.4f}")


if __name__ == "__main__":
    main()
