"""Two runs of one seed, with and without `train.deterministic`: do their losses agree to the last bit? (issue 4)

    python3 benchmarks/determinism_check.py [OVERRIDE ...]

Runs a small NSA model (compiled, on the GPU) four times: twice plain, twice with train.deterministic=true, and
prints each step's loss with the first step at which the two runs of a mode differ. The default shape takes the
block-centric selected backward (64 selection blocks a sequence), where the float32 atomics are.
"""

from __future__ import annotations

import sys
import tempfile

from nsa.config import load_config
from nsa.train.loop import train

SHAPE = ["model.dim=256", "model.n_layers=2", "model.mlp_hidden=768", "model.head_dim=64", "train.seq_len=4096",
         "train.batch_size=2", "train.steps=8", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "train.device=cuda", "parallel.compile=true",
         "parallel.allow_single_process=true"]


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as out:
        for mode in ("false", "true"):
            runs = [train(load_config(None, SHAPE + extra + [f"train.out_dir={out}", f"train.run_name={mode}{i}",
                                                              f"train.deterministic={mode}"])).losses
                    for i in range(2)]
            differ = [s for s in sorted(runs[0]) if runs[0][s] != runs[1][s]]
            print(f"train.deterministic={mode}: first step that differs: {differ[0] if differ else 'none'}")
            for step in sorted(runs[0]):
                print(f"  step {step}: {runs[0][step]!r} {runs[1][step]!r}")


if __name__ == "__main__":
    main()
