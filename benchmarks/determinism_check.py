"""Two runs of one seed, with and without `train.deterministic`: do their losses agree to the last bit? (issue 4)

    python3 benchmarks/determinism_check.py [--nproc N] [OVERRIDE ...]

Runs a small NSA model (compiled, on the GPU) four times: twice plain, twice with train.deterministic=true, and
prints each step's loss with the first step at which the two runs of a mode differ. With --nproc N each run is a
`torchrun --nproc_per_node=N` job (add parallel.mode=ddp or fsdp). The default shape takes the block-centric
selected backward (64 selection blocks a sequence), where the float32 atomics are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

SHAPE = ["model.dim=256", "model.n_layers=2", "model.mlp_hidden=768", "model.head_dim=64", "train.seq_len=4096",
         "train.batch_size=2", "train.steps=8", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "parallel.compile=true"]
MARK = "LOSSES "


def one_run(overrides: list[str]) -> dict[int, float]:
    """Train once in this process (under torchrun: this rank); rank 0 prints the losses as exact JSON."""
    import torch.distributed as dist

    from nsa.config import load_config
    from nsa.train.loop import train

    losses = train(load_config(None, overrides)).losses
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(MARK + json.dumps({str(k): float.hex(v) for k, v in losses.items()}), flush=True)
    return losses


def launched_run(nproc: int, overrides: list[str]) -> dict[int, float]:
    cmd = ["torchrun", f"--nproc_per_node={nproc}", __file__, "--child", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith(MARK))
    return {int(k): float.fromhex(v) for k, v in json.loads(line[len(MARK):]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=0, help="GPUs a run (torchrun); 0: one process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args()
    if args.child:
        one_run(extra)
        return
    device = [] if args.nproc else ["train.device=cuda", "parallel.allow_single_process=true"]
    with tempfile.TemporaryDirectory() as out:
        for mode in ("false", "true"):
            runs = []
            for i in range(2):
                overrides = SHAPE + device + extra + [f"train.out_dir={out}", f"train.run_name={mode}{i}",
                                                      f"train.deterministic={mode}"]
                runs.append(launched_run(args.nproc, overrides) if args.nproc else one_run(overrides))
            differ = [s for s in sorted(runs[0]) if runs[0][s] != runs[1][s]]
            print(f"train.deterministic={mode} {' '.join(extra)}: first step that differs: "
                  f"{differ[0] if differ else 'none'}")
            for step in sorted(runs[0]):
                print(f"  step {step}: {runs[0][step]!r} {runs[1][step]!r}")


if __name__ == "__main__":
    sys.exit(main())
