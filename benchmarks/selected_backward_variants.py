"""Where the Gluon selected backward's in-kernel dQ adds spend their time: the kernel as shipped against copies
with the adds changed.

Each variant is nsa/ops/triton/hopper_selected_backward.py with source edits (nsa.bench.common.kernel_variant),
timed at M7C's shape on one selection with the default inverse index (queued calls, GPU time, the accumulators'
zero fills included, as in training):
- "adds masked off": the dQ product, its layout conversion and the atomic instructions are all issued, but every
  lane's mask is false at run time, so no add reaches memory (its dQ is then zero; it only attributes time);
- "adds in bands across warps (before)": dQ converted to hopper_backward.add_io_layout, whose warps share each
  16-row band of the product (the thirty-second session's kernel: the conversion needs a block-wide barrier);
- "adds from the wgmma layout": the adds issued straight from the accumulator's registers (two floats a piece)
  instead of converted through shared memory to four-float row pieces;
- "adds a step later": each step's dQ carried in registers and added in the next step, after that step's first
  two products are issued (the last step's after the loop), so the tensor cores work while the adds are issued;
- "product only, no adds": the dQ product computed and folded into dK (wrong dK; it only attributes time);
- "no dQ": the shipped kernel with WRITE_DQ off (dK/dV alone).
Gradients are compared with the shipped kernel's: dK/dV and dQ are float32 sums whose order varies run to run, so a
faithful variant differs by float32 rounding (~1e-7 here), a variant that drops or changes work by far more.

    python3 benchmarks/selected_backward_variants.py [T] [BATCH]      (on a GPU; default 32768 2)
    python3 benchmarks/selected_backward_variants.py --offline        (no GPU: each variant compiled for sm_90)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from nsa.bench.attention import HP, SHAPES, selected_branch_inputs
from nsa.bench.common import format_table, kernel_variant, print_row, time_cuda
from nsa.ops.triton import hopper_selected_backward as shipped

SOURCE = Path(__file__).resolve().parents[1] / "nsa/ops/triton/hopper_selected_backward.py"
COLUMNS = ["variant", "ms", "rounds", "dK/dV max diff", "dQ max diff"]
ADD = """                    gl.atomic_add(dst, gl.convert_layout(dq * scale, add_l), mask=(rq < rows)[:, None],
                                  sem="relaxed")
"""
# "adds a step later" (see above): the carried state, its delivery after the next step's first two products, the
# last step's after the loop.
LOOP = "        for s in range(n_steps):\n"
CARRY = """        add_l: gl.constexpr = band_add_layout(num_warps, D)
        add_row: gl.constexpr = gl.SliceLayout(1, add_l)
        dq_prev = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
        rq_prev = gl.zeros([BLOCK_M], gl.int32, layout=add_row) + rows
        tq_prev = gl.zeros([BLOCK_M], gl.int64, layout=add_row)
"""
ISSUED = "            dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)\n"
DELIVER = """            dst = DQPART + (b * sdqb + tq_prev * sdqt + (g * h + rq_prev % h) * sdqh)[:, None] + gl.arange(
                0, D, layout=gl.SliceLayout(0, add_l))[None, :]
            gl.atomic_add(dst, gl.convert_layout(dq_prev, add_l), mask=(rq_prev < rows)[:, None], sem="relaxed")
"""
NOW = """                if DQ_ADD:
                    # A float32 dQ [B,T,H,D] of the branch, added into with relaxed atomics (programs that run
                    # together gather queries of one range when the index is split by query ranges).
                    add_l: gl.constexpr = band_add_layout(num_warps, D)
                    rq = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_l))
                    tq = (ent_smem.index(stage).load(gl.SliceLayout(1, add_l)) // n - bg * T).to(gl.int64)
                    dst = DQPART + (b * sdqb + tq * sdqt + (g * h + rq % h) * sdqh)[:, None] + gl.arange(
                        0, D, layout=gl.SliceLayout(0, add_l))[None, :]
"""
LATER = """                if DQ_ADD:
                    dq_prev = dq * scale
                    rq_prev = r0 + gl.arange(0, BLOCK_M, layout=add_row)
                    tq_prev = (ent_smem.index(stage).load(add_row) // n - bg * T).to(gl.int64)
"""
END = "        async_copy.wait_group(0)\n"
AFTER = "".join(line[4:] for line in DELIVER.splitlines(keepends=True))
VARIANTS = {
    "adds (shipped: bands per warp)": [],
    "adds masked off": [(ADD, ADD.replace("(rq < rows)", "(rq < rows - T)"))],
    "adds from the wgmma layout": [
        ("                    add_l: gl.constexpr = band_add_layout(num_warps, D)\n",
         "                    add_l: gl.constexpr = acc_layout\n"),
        (ADD, ADD.replace("gl.convert_layout(dq * scale, add_l)", "dq * scale")),
    ],
    "adds a step later": [
        (LOOP, CARRY + LOOP), (ISSUED, ISSUED + DELIVER), (NOW + ADD, LATER), (END, AFTER + END),
    ],
    "adds in bands across warps (before)": [
        ("                    add_l: gl.constexpr = band_add_layout(num_warps, D)\n",
         "                    add_l: gl.constexpr = add_io_layout(num_warps, D)\n"),
        ("hopper_backward import (_store_grad,", "hopper_backward import (_store_grad, add_io_layout,"),
    ],
    "product only, no adds": [(NOW + ADD, "                if DQ_ADD:\n                    dk_acc += dq\n")],
}


def offline(folder: Path) -> None:
    """Each variant compiled for sm_90 at M7C's head dim (registers, spills, shared memory, atomics)."""
    from offline_compile import compile_gluon, report

    from nsa.ops.triton.hopper_forward import _descriptor

    for name, edits in VARIANTS.items():
        module = kernel_variant(SOURCE, name, edits, folder)
        cfg = dict(module.hopper_backward_config(64))
        warps = cfg.pop("num_warps")
        kv = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16)
        descs = {"k_desc": _descriptor(kv, cfg["BLOCK_N"]), "v_desc": _descriptor(kv, cfg["BLOCK_N"])}
        types = {"Q": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "DKo": "*fp32", "DVo": "*fp32",
                 "DQPART": "*fp32", "scale_log2": "fp32", "scale": "fp32"}
        types |= {n: "*i32" for n in ("ITEM_KEY", "ITEM_START", "ITEM_COUNT", "ENTRIES")}
        consts = dict(n=16, h=6, D=64, WRITE_DQ=True, DQ_ADD=True, PARTIALS=False, **cfg)
        c = module._sel_bwd_hopper
        compiled = compile_gluon(c, descs, {k: v for k, v in consts.items() if k in c.arg_names}, types, warps,
                                 divisible=True)
        ptx = compiled.asm["ptx"]
        print(f"{name}: {report(compiled)}  red.global {ptx.count('red.global')} "
              f"(v4 {ptx.count('red.global.v4')}, v2 {ptx.count('red.global.v2')})", flush=True)


def timed(T: int, batch: int, folder: Path, rounds: int) -> None:
    H, G, D, _ = SHAPES["m7c"]
    n = HP["n_sel"]
    q, k, v, inv = selected_branch_inputs(T, batch)
    scale = D**-0.5
    do = torch.randn_like(q)
    # Row statistics of plausible size (lse ~ log of ~1,024 keys); the kernel's work does not depend on them.
    lse = torch.full((batch, T, H), 7.0, device=q.device)
    delta = 0.01 * torch.randn(batch, T, H, device=q.device)

    def runner(module, write_dq: bool):
        def run():
            dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
            dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
            dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if write_dq else q
            module.selected_backward_hopper(q, k, v, do, lse, delta, dk, dv, dq, inv, scale, n, write_dq, False,
                                            write_dq)
            return dk, dv, dq
        return run

    runs = {name: runner(kernel_variant(SOURCE, name, edits, folder), True) for name, edits in VARIANTS.items()}
    runs["no dQ"] = runner(shipped, False)
    times = {name: [] for name in runs}
    grads = {name: run() for name, run in runs.items()}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(time_cuda(run, queued=True))
    ref = grads["adds (shipped: bands per warp)"]
    rows = []
    for name, t in times.items():
        dk, dv, dq = grads[name]
        dkv = max((dk - ref[0]).abs().max().item(), (dv - ref[1]).abs().max().item())
        diff = (dq - ref[2]).abs().max().item() if name != "no dQ" else float("nan")
        rows.append({"variant": name, "ms": statistics.median(t), "rounds": " ".join(f"{x:.3f}" for x in t),
                     "dK/dV max diff": f"{dkv:.2e}", "dQ max diff": f"{diff:.2e}"})
        print_row(rows[-1], COLUMNS)
    print(f"\nm7c T={T} batch {batch}, medians of {rounds} rounds ({torch.cuda.get_device_name()})\n"
          + format_table(rows, COLUMNS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("T", nargs="?", type=int, default=32768)
    ap.add_argument("batch", nargs="?", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--offline", action="store_true", help="compile each variant for sm_90 instead of timing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        offline(Path(tmp)) if args.offline else timed(args.T, args.batch, Path(tmp), args.rounds)


if __name__ == "__main__":
    main()
