"""What the block-centric selected forward's per-slot partial stores cost it: the Gluon kernel as shipped against
copies with its epilogue changed.

Each variant is nsa/ops/triton/hopper_selected_forward.py with source edits (nsa.bench.common.kernel_variant),
timed on one selection at M7C's shape with the default inverse index (queued calls, GPU time):
- "no output stores": each row's normalised output is summed into its log-sum-exp store, so the products stay live
  but the 8 KB of partial outputs a row step writes are gone (its lse values are then wrong; it only attributes
  time);
- "stores in bands per warp": the output converted to a layout whose warps hold the 16-row bands of the product
  they computed (M7C head dim 64 only), so the conversion needs no block-wide barrier (what the selected backward's
  dQ adds gained from, thirty-third session); its partials must equal the shipped ones;
- "stores from the wgmma layout": the output stored straight from the accumulator's registers (4-byte pieces)
  instead of converted through shared memory to 16-byte row pieces; its partials must equal the shipped ones.

    python3 benchmarks/selected_forward_variants.py [T] [BATCH]      (on a GPU; default 32768 2)
    python3 benchmarks/selected_forward_variants.py --offline        (no GPU: each variant compiled for sm_90)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from nsa.bench.attention import HP, SHAPES, selected_branch_inputs
from nsa.bench.common import format_table, kernel_variant, print_row, time_cuda

SOURCE = Path(__file__).resolve().parents[1] / "nsa/ops/triton/hopper_selected_forward.py"
COLUMNS = ["variant", "ms", "same partials"]
LSE_STORE = "            gl.store(LSEPART + part_l, m + gl.log2(l_sum), mask=rl < rows)\n"
O_STORE = """            gl.store(OPART + (part * D)[:, None] + d_io[None, :], gl.convert_layout(out.to(dtype), io),
                     mask=(rq < rows)[:, None])
"""
ROWS_STORE = """            rq = r0 + gl.arange(0, BLOCK_M, layout=io_row)
            part = ent_smem.index(stage).load(io_row).to(gl.int64) * h + rq % h
"""
BAND_STORE = """            band: gl.constexpr = gl.BlockedLayout([4, 8], [4, 8], [4, 1], [1, 0])
            rq = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, band))
            part = ent_smem.index(stage).load(gl.SliceLayout(1, band)).to(gl.int64) * h + rq % h
            gl.store(OPART + (part * D)[:, None] + gl.arange(0, D, layout=gl.SliceLayout(0, band))[None, :],
                     gl.convert_layout(out.to(dtype), band), mask=(rq < rows)[:, None])
"""
VARIANTS = {
    "as shipped": [],
    "no output stores": [
        (LSE_STORE, ""),
        (O_STORE, "            gl.store(LSEPART + part_l, m + gl.log2(l_sum) + gl.convert_layout(gl.sum(out, 1), "
                  "row_s), mask=rl < rows)\n"),
    ],
    "stores in bands per warp": [(ROWS_STORE + O_STORE, BAND_STORE)],
    "stores from the wgmma layout": [
        (O_STORE, """            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            gl.store(OPART + (gl.convert_layout(part_l, row_o) * D)[:, None]
                     + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))[None, :], out.to(dtype),
                     mask=(gl.convert_layout(rl, row_o) < rows)[:, None])
"""),
    ],
}


def offline(folder: Path) -> None:
    """Each variant compiled for sm_90 at M7C's head dim (registers, shared memory, stores)."""
    from offline_compile import compile_gluon, report

    from nsa.ops.triton.hopper_forward import _descriptor

    for name, edits in VARIANTS.items():
        module = kernel_variant(SOURCE, name, edits, folder)
        cfg = module.hopper_selected_forward_config(64)
        warps = cfg.pop("num_warps")
        kv = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16)
        descs = {"k_desc": _descriptor(kv, cfg["BLOCK_N"]), "v_desc": _descriptor(kv, cfg["BLOCK_N"])}
        types = {"Q": "*bf16", "OPART": "*bf16", "LSEPART": "*fp32", "scale_log2": "fp32"}
        types |= {n: "*i32" for n in ("ITEM_KEY", "ITEM_START", "ITEM_COUNT", "ENTRIES")}
        c = compile_gluon(module._sel_fwd_hopper, descs, dict(n=16, h=6, D=64, **cfg), types, warps, divisible=True)
        print(f"{name}: {report(c)}  st.global {c.asm['ptx'].count('st.global')}", flush=True)


def timed(T: int, batch: int, folder: Path) -> None:
    H, G, D, _ = SHAPES["m7c"]
    n = HP["n_sel"]
    q, k, v, inv = selected_branch_inputs(T, batch)
    scale = D**-0.5
    rows, shipped = [], None
    for name, edits in VARIANTS.items():
        module = kernel_variant(SOURCE, name, edits, folder)
        opart = torch.zeros(batch * G * T * n, H // G, D, device=q.device, dtype=q.dtype)
        lsepart = torch.zeros(batch * G * T * n, H // G, device=q.device)
        run = lambda: module.selected_forward_hopper(q, k, v, opart, lsepart, inv, scale, n)  # noqa: E731
        run()
        shipped = shipped or (opart.clone(), lsepart.clone())
        same = torch.equal(opart, shipped[0]) and torch.equal(lsepart, shipped[1])
        rows.append({"variant": name, "ms": time_cuda(run, queued=True), "same partials": same})
        print_row(rows[-1], COLUMNS)
    print(f"\nm7c T={T} batch {batch} ({torch.cuda.get_device_name()})\n" + format_table(rows, COLUMNS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("T", nargs="?", type=int, default=32768)
    ap.add_argument("batch", nargs="?", type=int, default=2)
    ap.add_argument("--offline", action="store_true", help="compile each variant for sm_90 instead of timing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        offline(Path(tmp)) if args.offline else timed(args.T, args.batch, Path(tmp))


if __name__ == "__main__":
    main()
