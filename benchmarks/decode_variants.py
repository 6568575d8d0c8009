"""Where one layer's decode attention spends its time: the kernels as shipped against copies with one change.

Each variant is nsa/ops/triton/decode.py with source edits, written to a temporary module and run on the
same random M7C-shaped cache (12 query heads, 2 key/value groups, head dim 64, NSA 32/16/64/16/512) at one
context, for each batch size: the layer's attention is captured in a CUDA graph and replayed back to back
(GPU time per call), and its kernels are timed one by one under the profiler. Every variant's choice of
blocks must equal the shipped one's and its output must agree (except "diag:" variants, which leave work out to
show what it costs). Run on a GPU from the repository root:

    python3 benchmarks/decode_variants.py [CONTEXT] [BATCHES] [--only TEXT]     (default: 65536 1,16)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nsa.bench.common import format_table, kernel_variant, print_row, time_cuda
from nsa.bench.common import graphed

SOURCE = Path(__file__).resolve().parents[1] / "nsa/ops/triton/decode.py"
HEADS, GROUPS, DIM = 12, 2, 64
HYPER = dict(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512, scale=DIM**-0.5)
ONE_CHUNK = ("cpp = _chunks_per_program(n_chunks, bg, q.device)", "cpp = 1")
NO_EQ9 = [  # the compressed pass with zero selection scores (R = -1 selects the edit's branch)
    ("    if R > 0:\n        # R compressed",
     "    if R == -1:\n        sc_cur = tl.zeros([HP, K], tl.float32)\n        sc_nxt = sc_cur\n    elif R > 0:\n        # R compressed"),
    ("C=max(16, triton.next_power_of_2(chunk_tokens)), R=R,", "C=max(16, triton.next_power_of_2(chunk_tokens)), R=-1,"),
]
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "as shipped": [],
    "ranking kernels 4 warps": [("rank_warps = dict(num_warps=2 if", "rank_warps = dict(num_warps=4 if")],
    "chunk statistics 8 at a time": [("PTS=min(64, triton.next_power_of_2(n_chunks))", "PTS=8")],
    "values loaded after the scores": [
        ("k, v = load_tile(KC + base, off, dk, ci_ok, DK), load_tile(VC + base, off, dv, ci_ok, DV)",
         "k = load_tile(KC + base, off, dk, ci_ok, DK)"),
        ("acc = tl.dot(p.to(v.dtype), v)",
         "v = load_tile(VC + base, off, dv, ci_ok, DV)\n    acc = tl.dot(p.to(v.dtype), v)"),
        ("k, v = load_tile(kp, off, dk, ok, DK), load_tile(vp, off, dv, ok, DV)", "k = load_tile(kp, off, dk, ok, DK)"),
        ("p = tl.exp2(s - tl.where(m == float(\"-inf\"), 0.0, m)[:, None])\n    row",
         "p = tl.exp2(s - tl.where(m == float(\"-inf\"), 0.0, m)[:, None])\n"
         "    v = load_tile(vp, off, dv, ok, DV)\n    row"),
    ],
    "general overlaps (no two-weight stencil)": [("R = stencil_rank(block_len, block_stride, sel_block)", "R = 0")],
    "compressed pass: one chunk a program": [ONE_CHUNK],
    "compressed pass: 2 chunks a program": [("cpp = _chunks_per_program(n_chunks, bg, q.device)", "cpp = 2")],
    "compressed pass: 8 chunks a program": [("cpp = _chunks_per_program(n_chunks, bg, q.device)", "cpp = 8")],
    "compressed pass: 2 stages": [("STAGES=TUNING.decode_chunk_stages", "STAGES=2")],
    "compressed pass: 1 stage": [("STAGES=TUNING.decode_chunk_stages", "STAGES=1")],
    # Diagnostics (not checked against the shipped choices): what each part of the compressed pass costs.
    "diag: pass without Eq. 9": NO_EQ9,
    "diag: pass without p @ v": [("acc = tl.dot(p.to(v.dtype), v)", "acc = tl.zeros([HP, BLOCK_DV], tl.float32)")],
    "diag: pass with one chunk, without Eq. 9": [ONE_CHUNK, *NO_EQ9],
}
COLUMNS = ["variant", "batch", "us", "kernels_us"]


def load_variant(name: str, edits: list[tuple[str, str]], folder: Path):
    return kernel_variant(SOURCE, name, edits, folder)


def make_cache(batch: int, context: int) -> dict:
    """Random keys/values of every branch for `context` tokens (the query at the last one), bf16."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    l, d = HYPER["block_len"], HYPER["block_stride"]
    n_cmp = (context - l) // d + 1
    return dict(q=rand(batch, HEADS, DIM), gates=torch.rand(batch, HEADS, 3, device="cuda", generator=gen).bfloat16(),
                k_cmp=rand(batch, n_cmp, GROUPS, DIM), v_cmp=rand(batch, n_cmp, GROUPS, DIM),
                n_cmp=torch.full((batch,), n_cmp, device="cuda"),
                **{name: rand(batch, context, GROUPS, DIM) for name in ("k_sel", "v_sel", "k_win", "v_win")},
                positions=torch.full((batch,), context - 1, device="cuda"),
                selected=torch.empty(batch, GROUPS, HYPER["n_sel"], dtype=torch.long, device="cuda"))


def kernel_times_us(fn, repeats: int = 20) -> str:
    """Each kernel's mean GPU time in microseconds, in launch order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " ".join(f"{e.key.strip('_').removesuffix('_kernel')}={e.device_time_total / e.count:.1f}"
                    for e in events if e.count >= repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("context", nargs="?", type=int, default=65536)
    ap.add_argument("batches", nargs="?", default="1,16")
    ap.add_argument("--only", default="", help="run the shipped kernels and the variants whose names contain this")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        modules = {name: load_variant(name, edits, Path(tmp)) for name, edits in VARIANTS.items()
                   if name == "as shipped" or args.only in name}
        for batch in (int(b) for b in args.batches.split(",")):
            cache = make_cache(batch, args.context)
            shipped = None
            for name, module in modules.items():
                call = lambda: module.decode_attention_triton(**cache, **HYPER)  # noqa: E731
                out, _ = call()
                chosen = cache["selected"].clone()
                if shipped is None:
                    shipped = (out, chosen)
                elif not name.startswith("diag:") and (not torch.equal(chosen, shipped[1])
                                                       or not torch.allclose(out, shipped[0], atol=2e-2)):
                    raise SystemExit(f"variant {name!r} at batch {batch} disagrees with the shipped kernels")
                rows.append({"variant": name, "batch": batch, "us": 1e3 * time_cuda(graphed(call), queued=True),
                             "kernels_us": kernel_times_us(call)})
                print_row(rows[-1], COLUMNS)
    print(f"\ncontext {args.context} ({torch.cuda.get_device_name()})\n" + format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
