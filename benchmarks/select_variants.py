"""Where the selection kernel's time goes: the kernel as shipped against copies with one part changed.

Each variant is nsa/ops/triton/selection.py with one source edit, written to a temporary module and
timed on the same inputs (queued calls, GPU time). Variants that skip work give wrong indices; they
only attribute time. Run on a GPU from the repository root:

    python3 benchmarks/select_variants.py [SHAPE] [T] [--batch B]      (default: m7c 65536 x 1)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.bench.common import format_table, kernel_variant, print_row, time_cuda
from nsa.ops.triton.range_attention import MODE_CMP, range_attention_fwd

SOURCE = Path(__file__).resolve().parents[1] / "nsa/ops/triton/selection.py"
COLUMNS = ["variant", "ms", "differs"]
MERGE = "return _merge_top(best, tl.where(candidate, key, -1)), carry"
TRANS = "trans = block_t * hp <= TUNING.select_transposed_max_rows"
STAGES = "num_stages=1 if Dk > 128 else 2,"
VARIANTS = {
    "as shipped": [],
    "scores untransposed": [(TRANS, "trans = False")],
    "scores transposed": [(TRANS, "trans = True")],
    "overlap products (no two-weight stencil)": [("R = stencil_rank(block_len", "R = 0 * stencil_rank(block_len")],
    "no ranking (elementwise max)": [(MERGE, "return tl.maximum(best, tl.where(candidate, key, -1)), carry")],
    "chunk sort, no merge": [(MERGE, "return tl.maximum(best, tl.sort(tl.where(candidate, key, -1))), carry")],
    "heads padded to a power of two (one set)": [("ha = 1 << (h.bit_length() - 1) if trans else hp", "ha = hp")],
    "no exp": [("tl.exp2(st)", "tl.maximum(st, 0.0)"), ("tl.exp2(s)", "tl.maximum(s, 0.0)")],
    "registers capped at 168 (three programs an SM)": [(STAGES, STAGES + " maxnreg=168,")],
    "registers capped at 128 (four programs an SM, spills)": [(STAGES, STAGES + " maxnreg=128,")],
    "one stage (no prefetch of the next chunk's keys)": [(STAGES, "num_stages=1,")],
}


def load_variant(name: str, edits: list[tuple[str, str]], folder: Path):
    return kernel_variant(SOURCE, name, edits, folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="m7c", choices=sorted(SHAPES))
    ap.add_argument("T", nargs="?", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    H, G, Dk, Dv = SHAPES[args.shape]
    q, kc, vc = (t.detach() for t in make_inputs(args.T, H, G, Dk, Dv, batch=args.batch)[:3])
    scale = Dk**-0.5
    l, d, lp, n = (HP[k] for k in ("block_len", "block_stride", "sel_block", "n_sel"))
    _, lse = range_attention_fwd(q, kc, vc, MODE_CMP, scale, l, d, HP["window"])
    rows, shipped = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name, edits in VARIANTS.items():
            module = load_variant(name, edits, Path(tmp))
            select = lambda: module.select_blocks_fwd(q, kc, lse, scale, l, d, lp, n)  # noqa: E731
            idx = select()
            shipped = idx if shipped is None else shipped
            differ = (idx != shipped).any(-1).float().mean().item()  # share of (token, group) choosing otherwise
            rows.append({"variant": name, "ms": time_cuda(select, queued=True), "differs": differ})
            print_row(rows[-1], COLUMNS)
    print(f"\n{args.shape} T={args.T} x {args.batch} ({torch.cuda.get_device_name()})\n" + format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
