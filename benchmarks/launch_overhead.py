"""Host time of one launch of each range kernel, Gluon and Triton (cProfile of back-to-back calls), at M7C 2k x 16:
where a Gluon call's host time goes.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/launch_overhead.py'
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from hopper_ab import calls
from nsa.ops.triton.tuning import TUNING


def main() -> None:
    for kernel, switch in (("fwd", "hopper_forward"), ("dkdv", "hopper_backward")):
        fn = calls("m7c", 2048, 16, kernel)["compressed"]
        for gluon in (True, False):
            setattr(TUNING, switch, gluon)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{kernel} {'gluon' if gluon else 'triton'}: {host:.1f} us of host time per call", flush=True)
            if gluon:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
        setattr(TUNING, switch, True)


if __name__ == "__main__":
    main()
