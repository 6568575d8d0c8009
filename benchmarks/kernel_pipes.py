"""Where the attention kernels' cycles go, by Nsight Compute: our kernels against cuDNN's and flash's dense
kernels at the same shape (pipe utilisation, stall reasons, occupancy, DRAM and L2 traffic). Ours are the range
and dQ kernels and, at long sequences, the block-centric selected branch, its merge and the selection.

    bash -c 'source benchmarks/gpu_env.sh; python3 benchmarks/kernel_pipes.py m7c 2048 16 --out DIR'

Runs ncu on itself (--run nsa|cudnn|flash does one forward+backward for it) and writes one CSV of metrics per
run plus a short table: the instruction pipes that bound a kernel at D=64 are the tensor cores (wgmma), the
MUFU/XU unit (exp2) and the FMA/ALU units (scaling, masks, row max and sum), so those are the columns; the
selected branch's partials make DRAM traffic matter too (megabytes read and written).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

METRICS = {
    "tensor %": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "xu %": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "fma %": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "alu %": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "lsu %": "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "issue %": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "dram %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2 %": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram rd MB": "dram__bytes_read.sum",
    "dram wr MB": "dram__bytes_write.sum",
    "warps": "sm__warps_active.avg.per_cycle_active",
    "regs": "launch__registers_per_thread",
    "ns": "gpu__time_duration.sum",
    "inst": "smsp__inst_executed.sum",
    "st long sb": "smsp__average_warp_latency_issue_stalled_long_scoreboard",
    "st wait": "smsp__average_warp_latency_issue_stalled_wait",
    "st mio": "smsp__average_warp_latency_issue_stalled_mio_throttle",
    "st math": "smsp__average_warp_latency_issue_stalled_math_pipe_throttle",
    "st barrier": "smsp__average_warp_latency_issue_stalled_barrier",
    "st short sb": "smsp__average_warp_latency_issue_stalled_short_scoreboard",
    "st selected": "smsp__average_warp_latency_issue_stalled_selected",
    "st not sel": "smsp__average_warp_latency_issue_stalled_not_selected",
    "st lg": "smsp__average_warp_latency_issue_stalled_lg_throttle",
    "st drain": "smsp__average_warp_latency_issue_stalled_drain",
}
KERNELS = {
    # Triton's kernels and the Gluon ones; at 32k and beyond the selected branch is block-centric (_sel_*), its
    # partials merged by _finalize_kernel.
    "nsa": "regex:_range_fwd|_range_bwd_dkdv|_range_dkdv|_query_grad|_sel_|_finalize|_select_kernel|_items_kernel",
    "cudnn": "regex:sdpa|cudnn",
    "flash": "regex:flash",
}


def run_once(kind: str, shape: str, T: int, batch: int) -> None:
    import torch

    from nsa.bench.attention import HP, SHAPES, _dense, _dense_inputs, make_inputs
    from nsa.ops import nsa_attention

    H, G, Dk, Dv = SHAPES[shape]
    ins = make_inputs(T, H, G, Dk, Dv, batch=batch)
    if kind == "nsa":
        out = nsa_attention(*ins, **HP)
        out.backward(torch.randn_like(out))
    else:
        fwd, tensors = _dense(_dense_inputs(ins), kind)
        out = fwd()
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def profile(kind: str, shape: str, T: int, batch: int, out: Path) -> list[dict]:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    metrics = list(METRICS.values())
    while True:
        cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "-k", KERNELS[kind],
               "--metrics", ",".join(metrics),
               sys.executable, __file__, shape, str(T), str(batch), "--run", kind]
        res = subprocess.run(cmd, capture_output=True, text=True)
        unknown = [m for m in metrics if m in res.stdout + res.stderr and "ERROR" in res.stdout + res.stderr]
        if res.returncode == 0 or not unknown:
            break
        print(f"{kind}: ncu refused {unknown[0]}; dropped")  # this ncu version lacks that metric
        metrics.remove(unknown[0])
    path = out / f"ncu_{kind}_{shape}_{T}x{batch}.csv"
    path.write_text(res.stdout + "\n# stderr\n" + res.stderr)
    rows = read_rows(path)
    if not rows:
        print(f"{kind}: ncu gave no rows (rc {res.returncode}):\n{res.stderr[-2000:]}\n{res.stdout[-2000:]}")
    return rows


def read_rows(path: Path) -> list[dict]:
    """The kernels' rows of an `ncu --csv --page raw` output (its second line holds units)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines)))) if lines else []
    return [r for r in rows if r.get("Kernel Name") and not r["Kernel Name"].startswith("(")]


def value(row: dict, metric: str) -> str:
    """A metric's value as a short string; a stall counter is asked for by its base name and read as .pct."""
    v = row.get(metric, row.get(metric + ".pct", ""))
    try:
        x = float(v.replace(',', ''))
        return f"{x / 1e6 if metric.startswith('dram__bytes') else x:.3g}"  # base units: bytes -> MB
    except ValueError:
        return v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape")
    p.add_argument("T", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("--run", choices=sorted(KERNELS))
    p.add_argument("--out", default="ncu-out")
    p.add_argument("--kinds", default="nsa,cudnn,flash")
    p.add_argument("--tables-only", action="store_true", help="rebuild the table from the CSVs in --out")
    ns = p.parse_args()
    if ns.run:
        run_once(ns.run, ns.shape, ns.T, ns.batch)
        return
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    cols = list(METRICS)
    table = ["kernel | " + " | ".join(cols)]
    for kind in ns.kinds.split(","):
        saved = out / f"ncu_{kind}_{ns.shape}_{ns.T}x{ns.batch}.csv"
        rows = read_rows(saved) if ns.tables_only else profile(kind, ns.shape, ns.T, ns.batch, out)
        for r in rows:
            table.append(f"{kind}:{r['Kernel Name'][:48]} | " + " | ".join(value(r, METRICS[c]) for c in cols))
    text = "\n".join(table)
    (out / f"pipes_{ns.shape}_{ns.T}x{ns.batch}.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
