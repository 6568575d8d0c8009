"""Localise the 65k-token CUDA-graph replay failure of item_order.py's first form (s30).

Kept as run in the thirty-first session (benchmarks/RESULTS.md). Its failures come from this script, not from the
library: the loop rebinds `inv` each iteration and keeps only the captured graph (the lambda holding `inv` is
dropped after capture), so the inverse index an earlier graph reads is freed and overwritten by the next
variant's allocations. With "hold", every variant's `inv` is kept in a list: run on an H100 in the thirty-second
session, every case then replayed and the forward graphs matched eager exactly, while the same run without "hold"
failed (held_index_s32.txt).

    python graph_check.py sync_keep|queued_keep ONLY [hold] [kernel|bwd] [triton] [T=N] [B=N]

ONLY ("" for all) keeps the variants whose name contains it.
"""
import sys, torch
from nsa.bench.attention import HP, SHAPES, make_inputs
from nsa.ops import select_blocks
from nsa.ops.triton import query_grad as qg, range_attention as ra, selected_attention as sa
from nsa.ops.triton.inverse_index import inverse_index
from nsa.ops.triton.tuning import TUNING

mode = sys.argv[1]  # "sync" (sync after each replay) or "queued"
only = sys.argv[2] if len(sys.argv) > 2 else ""
if "triton" in sys.argv: TUNING.hopper_selected_forward = False; TUNING.hopper_selected_backward = False
TLEN = next((int(a[2:]) for a in sys.argv if a.startswith("T=")), 32768)
BATCH = next((int(a[2:]) for a in sys.argv if a.startswith("B=")), 65536 // TLEN)
T, batch = TLEN, BATCH
H, G, Dk, Dv = SHAPES["m7c"]; sb = HP["sel_block"]; hp = (HP["block_len"], HP["block_stride"], HP["window"])
q, k_cmp, v_cmp, k, v, k_win, v_win, gates = (x.detach() for x in make_inputs(T, H, G, Dk, Dv, batch=batch))
scale = Dk ** -0.5
idx = select_blocks(q, k_cmp, **{x: HP[x] for x in ("block_len", "block_stride", "sel_block", "n_sel")})
o_cmp, o_win, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
others = [ra.range_attention_fwd(q, kk, vv, m, scale, *hp) for m, kk, vv in ((ra.MODE_CMP, k_cmp, v_cmp), (ra.MODE_WIN, k_win, v_win))]

def capture(fn, keep):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    if keep: return g, out
    return g, None

import triton
from nsa.ops.triton.hopper_selected_forward import selected_forward_hopper
if "prealloc" in sys.argv:
    class _T:
        pre = {}
        def __getattr__(self, a): return getattr(torch, a)
        def empty(self, *shape, **kw):
            if shape and shape[0] == batch * G * T * 16:
                key = (shape, kw.get("dtype"))
                if key not in self.pre: self.pre[key] = torch.empty(*shape, **kw)
                return self.pre[key]
            return torch.empty(*shape, **kw)
    sa.torch = _T()
def fwd_kernel(inv):
    B, h, n = batch, H // G, 16
    opart = torch.empty(B * G * T * n, h, Dv, device=q.device, dtype=q.dtype)
    lsepart = torch.empty(B * G * T * n, h, device=q.device, dtype=torch.float32)
    selected_forward_hopper(q, k, v, opart, lsepart, inv, scale, n)
    return opart, lsepart
graphs = []
eager_o = {}
held = []  # with "hold": every variant's inverse index lives as long as the graphs that read it
for name, qrange in (("unsplit", T), ("ranges 8192", 8192), ("ranges 4096", 4096)):
    inv = inverse_index(idx, -(-T // sb), TUNING.inverse_chunk, qrange)
    if "hold" in sys.argv: held.append(inv)
    o, o_sel, lse = sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb)
    delta = (do.float() * o_sel.float()).sum(-1)
    lse_g = torch.stack([others[0][1], lse, others[1][1]])
    delta_g = torch.stack([(do.float() * x.float()).sum(-1) for x in (others[0][0], o_sel, others[1][0])])
    def backward(inv=inv, lse=lse, delta=delta, lse_g=lse_g, delta_g=delta_g):
        dk, dv, sel = sa.selected_backward(q, k, v, idx, inv, do, lse, delta, scale, sb)
        return dk, dv, sel, qg.query_grad(q, do, lse_g, delta_g, scale, *hp, (k_cmp, v_cmp), (k_win, v_win), sel)
    if only and only not in name: continue
    eager_o[name] = o
    if "kernel" in sys.argv:
        graphs.append((f"{name} kernel", capture(lambda inv=inv: fwd_kernel(inv), True)))
    elif "bwd" not in sys.argv: graphs.append((f"{name} forward", capture(lambda inv=inv: sa.selected_forward(q, k, v, idx, inv, o_cmp, o_win, gates, scale, sb), mode.endswith("keep"))))
    for adds in ((True,) if "bwd" in sys.argv else ()):
        TUNING.selected_dq_adds = adds
        backward()
        graphs.append((f"{name} backward adds={adds}", capture(backward, mode.endswith("keep"))))
    torch.cuda.synchronize()
    print("captured", name, flush=True)
TUNING.selected_dq_adds = True
for r in range(5):
    for name, (g, _) in graphs:
        g.replay()
        if mode.startswith("sync"):
            torch.cuda.synchronize()
            print("ok", r, name, flush=True)
    torch.cuda.synchronize()
    print("round", r, "ok", flush=True)
for name, (g, out) in graphs:
    if out is not None and "forward" in name:
        ref = eager_o[name.replace(" forward", "")]
        print(name, "graph o vs eager o max abs diff", (out[0].float() - ref.float()).abs().max().item(), flush=True)
print("DONE", mode)
