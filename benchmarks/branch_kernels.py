"""The compressed and window branches on their own: our range kernels against torch's flex_attention (and dense
causal flash attention for scale), forward and backward, GPU time per call (queued), at M7C's shape.

    python benchmarks/branch_kernels.py [--cases 2048x16,65536x1] [--no-flex] [--out DIR]

Each case is TxBATCH. flex_attention computes the same masks (compressed: key i visible from query t when
i * d + l - 1 <= t; window: t - w < s <= t) from a block mask, so its outputs are checked against ours first.
Backward times: ours (dQ and dK/dV kernels; with --out, a profile of the two per case) and flex's whole backward
(autograd, forward+backward minus forward). Our backward takes lse and delta as gate_grads gives them for a gate of 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nsa.bench.attention import HP, SHAPES
from nsa.bench.common import environment, format_table, profile_to_file, time_cuda
from nsa.ops.triton import query_grad as qg
from nsa.ops.triton import range_attention as ra

H, G, D, _ = SHAPES["m7c"]
L, S, W = HP["block_len"], HP["block_stride"], HP["window"]


def _flex(mode: int, T: int, NK: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if mode == ra.MODE_CMP:
        def mask(b, h, q, kv):
            return kv * S + L - 1 <= q
    else:
        def mask(b, h, q, kv):
            return (kv <= q) & (q - kv < W)
    block_mask = create_block_mask(mask, None, None, T, NK, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):  # [B,T,H,D] in and out, as our kernels
        o, lse = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                          enable_gqa=True, return_lse=True)
        return o.transpose(1, 2), lse.transpose(1, 2)
    return run


def case(T: int, B: int, mode: int, out: Path | None, with_flex: bool = True) -> dict:
    gen = torch.Generator("cuda").manual_seed(0)
    NK = (T - L) // S + 1 if mode == ra.MODE_CMP else T
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = rnd(B, T, H, D), rnd(B, NK, G, D), rnd(B, NK, G, D), rnd(B, T, H, D)
    scale = D**-0.5
    o, lse = ra.range_attention_fwd(q, k, v, mode, scale, L, S, W)
    delta = (o.float() * do.float()).sum(-1)
    row = {"branch": "compressed" if mode == ra.MODE_CMP else "window", "T": T, "batch": B}
    row["ours_fwd"] = time_cuda(lambda: ra.range_attention_fwd(q, k, v, mode, scale, L, S, W), queued=True)
    row["ours_bwd"] = time_cuda(lambda: _backward(q, k, v, do, lse, delta, mode), queued=True)
    if with_flex:
        row |= _flex_row(mode, T, NK, q, k, v, do, o, lse)
    row["ours_fwdbwd"] = row["ours_fwd"] + row["ours_bwd"]
    if out:  # which of our two backward kernels the time goes to
        profile_to_file(lambda: _backward(q, k, v, do, lse, delta, mode),
                        out / f"profile_bwd_{row['branch']}_{T}x{B}.txt", repeats=5, rows=8)
    return row


def _backward(q, k, v, do, lse, delta, mode: int):
    """Our backward of one branch: its dK/dV kernel, then query_grad with only this branch."""
    dk, dv = ra.range_attention_dkdv(q, k, v, do, lse, delta, mode, D**-0.5, L, S, W)
    lse3, delta3 = lse.expand(3, *lse.shape), delta.expand(3, *delta.shape)
    branch = (k, v)
    dq = qg.query_grad(q, do, lse3, delta3, D**-0.5, L, S, W, branch if mode == ra.MODE_CMP else None,
                       branch if mode == ra.MODE_WIN else None, qg.SelectedDQ(qg.SEL_NONE))
    return dq, dk, dv


def _flex_row(mode: int, T: int, NK: int, q, k, v, do, o, lse) -> dict:
    """flex_attention's agreement with our output and its times, or why it did not run."""
    row = {}
    try:
        flex = _flex(mode, T, NK)
        fo, _ = flex(q, k, v)
        seen = torch.isfinite(lse)
        row["flex_max_err"] = (fo.float() - o.float())[seen].abs().max().item()
        row["flex_fwd"] = time_cuda(lambda: flex(q, k, v), queued=True)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd_bwd():
            out, _ = flex(qg, kg, vg)
            torch.autograd.grad(out, (qg, kg, vg), do)
        row["flex_fwdbwd"] = time_cuda(fwd_bwd, queued=True)
        row["flex_bwd"] = row["flex_fwdbwd"] - row["flex_fwd"]
    except Exception as err:  # noqa: BLE001 - a benchmark row records why flex did not run
        row["flex_error"] = f"{type(err).__name__}: {err}"[:300]
    return row


def dense(T: int, B: int) -> dict:
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, G, T, D, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        f = time_cuda(fwd, queued=True)
    fb = time_cuda(lambda: torch.autograd.grad(fwd(), (q, k, v), do), queued=True)
    return {"branch": "dense causal", "T": T, "batch": B, "ours_fwd": f, "ours_bwd": fb - f, "ours_fwdbwd": fb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="2048x16,65536x1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-flex", action="store_true", help="only our kernels (and dense)")
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    cols = ["branch", "T", "batch", "ours_fwd", "ours_bwd", "ours_fwdbwd", "flex_fwd", "flex_bwd", "flex_fwdbwd",
            "flex_max_err"]
    for spec in args.cases.split(","):
        T, B = (int(x) for x in spec.split("x"))
        for mode in (ra.MODE_CMP, ra.MODE_WIN):
            rows.append(case(T, B, mode, out, not args.no_flex))
            print(rows[-1], flush=True)
        rows.append(dense(T, B))
        print(rows[-1], flush=True)
    print(format_table(rows, cols))
    if out:
        report = {"environment": environment(), "rows": rows}
        (out / "branch_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
