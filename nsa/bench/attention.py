"""`nsa bench attention`: NSA kernels against dense SDPA (flash and cuDNN) and fla-core's parallel_nsa.

All numbers in one run on one GPU, bf16, batch 1 (or --batch), NSA with every branch and the gates
(l=32, d=16, l'=64, n=16, w=512); per call, also the host's share of one eager call (nsa_host_fwd_ms and
the like: issuing it while the GPU is busy). fla's parallel_nsa runs only where its group-size
rule allows (h a power of two >= 16) and, without flash-attn, has no window branch.

With --docs, packed documents (nsa.bench.mixtures): NSA with cu_seqlens against NSA unpacked at the stream's length,
dense attention within documents (FlexAttention's document block mask, PyTorch's varlen flash kernel, SDPA's
cuDNN kernel on nested jagged tensors) and fla's varlen parallel_nsa; and one document packed against the same tokens unpacked.
"""

from __future__ import annotations

import inspect

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..ops import NSAGeometry, nsa_attention
from ..plots.bench import picture
from .common import environment, format_table, graphed, host_ms, print_row, time_cuda, write_results
from .mixtures import Mixture, cu_seqlens, document_block_mask, jagged, parse_mixtures

SHAPES = {"m7c": (12, 2, 64, 64), "paper": (64, 4, 128, 128)}
"""name: (query heads, key/value heads, Dk, Dv)."""
LENGTHS = [2048, 4096, 8192, 16384, 32768, 65536, 131072]
GEOMETRY = NSAGeometry(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)
"""M7C's and the paper's NSA geometry, every shape's here."""


def make_inputs(T: int, H: int, G: int, Dk: int, Dv: int, seed: int = 0, batch: int = 1) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    nc = GEOMETRY.num_compressed_blocks(T)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    B = batch
    ins = [rnd(B, T, H, Dk), rnd(B, nc, G, Dk), rnd(B, nc, G, Dv), rnd(B, T, G, Dk), rnd(B, T, G, Dv),
           rnd(B, T, G, Dk), rnd(B, T, G, Dv),
           torch.rand(B, T, H, 3, generator=g, device="cuda", dtype=torch.bfloat16)]
    return [t.requires_grad_() for t in ins]


def eager_calls(shape: str, T: int) -> dict[str, Callable[[], object]]:
    """The three eager NSA calls the host-time scripts time, on make_inputs of `shape` at batch 1: 'forward, no grad'
    and 'forward' (returning o), 'forward+backward' (returning [o, every input's gradient])."""
    H, G, Dk, Dv = SHAPES[shape]
    ins = make_inputs(T, H, G, Dk, Dv)
    do = torch.randn(1, T, H, Dv, generator=torch.Generator("cuda").manual_seed(1), device="cuda",
                     dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        return nsa_attention(*ins, geometry=GEOMETRY)

    def inference() -> torch.Tensor:
        with torch.no_grad():
            return forward()

    def forward_backward() -> list[torch.Tensor]:
        for t in ins:
            t.grad = None
        out = forward()
        out.backward(do)
        return [out.detach()] + [t.grad for t in ins]

    return {"forward, no grad": inference, "forward": forward, "forward+backward": forward_backward}


def _fwd_bwd(forward, tensors):
    do = None

    def step():
        nonlocal do
        for t in tensors:
            t.grad = None
        out = forward()
        if do is None:
            do = torch.randn_like(out)
        out.backward(do)

    return step


def _nsa(ins):
    return lambda: nsa_attention(*ins, geometry=GEOMETRY)


DENSE_BACKENDS = ("flash", "cudnn")
"""Dense references: SDPA's flash backend (FlashAttention-2, the dense reference of docs/performance.md) and cuDNN's
attention, which PyTorch picks by default on Hopper and which a dense model's training step runs."""


def _dense_inputs(ins) -> list[torch.Tensor]:
    """Dense attention's q, k, v [B,H,T,D] (k and v repeated over each group's heads), shared by every backend."""
    q, k, v = ins[0], ins[3], ins[4]
    h = q.shape[2] // k.shape[2]
    qd = q.detach().transpose(1, 2).contiguous().requires_grad_()
    kd = k.detach().repeat_interleave(h, 2).transpose(1, 2).contiguous().requires_grad_()
    vd = v.detach().repeat_interleave(h, 2).transpose(1, 2).contiguous().requires_grad_()
    return [qd, kd, vd]


def _dense(tensors: list[torch.Tensor], backend: str = "flash"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fwd():
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(*tensors, is_causal=True)

    return fwd, tensors


def _fla(ins, cu_seqlens: torch.Tensor | None = None):
    """fla's parallel_nsa over our selected-branch keys/values (packed documents with cu_seqlens, int64), or None
    where it refuses the shape."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fla.ops.nsa import parallel_nsa
    except ImportError:
        return None
    q, k, v, gates = ins[0], ins[3], ins[4], ins[7]
    h = q.shape[2] // k.shape[2]
    if h < 16 or h & (h - 1):
        return None
    qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gc, gs = (gates[..., i].detach().contiguous() for i in (0, 1))

    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}

    def fwd():
        return parallel_nsa(qf, kf, vf, g_cmp=gc, g_slc=gs, block_counts=GEOMETRY.n_sel,
                            block_size=GEOMETRY.sel_block, **packed)

    return fwd, [qf, kf, vf]


def _timed(fn, queued: bool = False) -> float | None:
    try:
        return time_cuda(fn, queued=queued)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    except RuntimeError as e:  # e.g. no cuDNN kernel for this shape: that reference is left out, not the run
        if "No available kernel" not in str(e):
            raise
        return None


def _host(fn) -> float | None:
    """host_ms of fn, or None where the call cannot run (as _timed)."""
    try:
        return host_ms(fn)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _graphed(fn):
    """fn's CUDA-graph replay (common.graphed), or None where fn cannot be captured (a host sync inside)."""
    try:
        return graphed(fn)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # capture refused, or no memory
        print(f"  (not captured: {str(e).splitlines()[0][:120]})")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return None


def _time_as(fn, graphs: bool) -> float | None:
    """fn's time: each call as a caller sees it, or (graphs) one CUDA-graph replay of it."""
    if not graphs:
        return _timed(fn)
    replay = _graphed(fn)
    return _timed(replay) if replay else None


def compare(shape: str, T: int, backward: bool, use_fla: bool, batch: int = 1, graphs: bool = False) -> dict:
    H, G, Dk, Dv = SHAPES[shape]
    row = {"shape": f"{shape} {H}/{G}/{Dk}", "T": T}
    try:
        ins = make_inputs(T, H, G, Dk, Dv, batch=batch)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return row
    dense_tensors = _dense_inputs(ins)
    dense, cudnn = (_dense(dense_tensors, backend) for backend in DENSE_BACKENDS)
    fla = _fla(ins) if use_fla else None
    with torch.no_grad():
        row["nsa_fwd_ms"] = _time_as(_nsa(ins), graphs)
        if not graphs:  # the host's share of one eager call (a replay has none to speak of)
            row["nsa_host_fwd_ms"] = _host(_nsa(ins))
            row["dense_host_fwd_ms"] = _host(dense[0])
        row["dense_fwd_ms"] = _time_as(dense[0], graphs)
        row["cudnn_fwd_ms"] = _time_as(cudnn[0], graphs)
        row["fla_fwd_ms"] = _time_as(fla[0], graphs) if fla else None
    if backward:
        row["nsa_fwdbwd_ms"] = _time_as(_fwd_bwd(_nsa(ins), ins), graphs)
        if not graphs:
            row["nsa_host_fwdbwd_ms"] = _host(_fwd_bwd(_nsa(ins), ins))
        row["dense_fwdbwd_ms"] = _time_as(_fwd_bwd(*dense), graphs)
        row["cudnn_fwdbwd_ms"] = _time_as(_fwd_bwd(*cudnn), graphs)
        row["fla_fwdbwd_ms"] = _time_as(_fwd_bwd(*fla), graphs) if fla else None
    for kind in ("fwd", "fwdbwd"):
        nsa, dense_ms, cudnn_ms, fla_ms = (row.get(f"{who}_{kind}_ms") for who in ("nsa", "dense", "cudnn", "fla"))
        row[f"speedup_{kind}"] = dense_ms / nsa if nsa and dense_ms else None
        row[f"vs_cudnn_{kind}"] = cudnn_ms / nsa if nsa and cudnn_ms else None
        row[f"vs_fla_{kind}"] = fla_ms / nsa if nsa and fla_ms else None
    del ins, dense_tensors, dense, cudnn, fla
    torch.cuda.empty_cache()
    return row


def components(shape: str, T: int, batch: int = 1) -> list[dict]:
    """GPU milliseconds of every stage of the NSA forward and backward at one length (calls queued back to back,
    so the host's launch time is hidden as it is inside a training step)."""
    from ..ops.branches import BLOCKS, MODE_CMP, MODE_WIN
    from ..ops.dispatch import (query_grad, select_blocks, selected_backward, selected_forward, selected_path,
                                span_dkdv, span_forward)
    from ..ops.triton.gating import gate_grads
    from ..ops.triton.inverse_index import build_inverse_index

    H, G, Dk, Dv = SHAPES[shape]
    q, kc, vc, ks, vs, kw, vw, gates = (t.detach() for t in make_inputs(T, H, G, Dk, Dv, batch=batch))
    scale = Dk**-0.5
    geo, lp = GEOMETRY, GEOMETRY.sel_block
    o_cmp, lse_cmp = span_forward(q, kc, vc, MODE_CMP, scale, geo)
    idx = select_blocks(q, kc, lse_cmp, scale, geo)
    inv = build_inverse_index(idx, T, lp)
    o_win, lse_win = span_forward(q, kw, vw, MODE_WIN, scale, geo)
    _, o_sel, lse_sel = selected_forward(q, ks, vs, idx, inv, o_cmp, o_win, gates, scale, geo)
    do = torch.randn_like(o_cmp)
    lses = (lse_cmp, lse_sel, lse_win)
    _, delta, lse_g = gate_grads(do, o_cmp, o_sel, o_win, gates, *lses)
    *_, sel_dq = selected_backward(q, ks, vs, idx, inv, do, lse_g[1], delta[1], scale, geo)
    stages = {
        "fwd: compressed attention": lambda: span_forward(q, kc, vc, MODE_CMP, scale, geo),
        "fwd: scoring + top-n": lambda: select_blocks(q, kc, lse_cmp, scale, geo),
        "fwd: inverse index": lambda: build_inverse_index(idx, T, lp),
        "fwd: window attention": lambda: span_forward(q, kw, vw, MODE_WIN, scale, geo),
        "fwd: selected attention + gated sum": lambda: selected_forward(
            q, ks, vs, idx, inv, o_cmp, o_win, gates, scale, geo),
        "bwd: gate grads + deltas": lambda: gate_grads(do, o_cmp, o_sel, o_win, gates, *lses),
        "bwd: selected dk/dv (+ dq parts)": lambda: selected_backward(
            q, ks, vs, idx, inv, do, lse_g[1], delta[1], scale, geo),
        "bwd: window dk/dv": lambda: span_dkdv(q, kw, vw, do, lse_g[2], delta[2], MODE_WIN, scale, geo),
        "bwd: compressed dk/dv": lambda: span_dkdv(q, kc, vc, do, lse_g[0], delta[0], MODE_CMP, scale, geo),
        "bwd: dq (all branches)": lambda: query_grad(q, do, lse_g, delta, scale, geo, (kc, vc), (kw, vw), sel_dq),
    }
    if selected_path(T, H // G, lp) != BLOCKS:  # only the block-centric path builds the index
        del stages["fwd: inverse index"]
    rows = [{"shape": shape, "T": T, "stage": name, "ms": _timed(fn, queued=True)} for name, fn in stages.items()]
    torch.cuda.empty_cache()
    return rows


SWEEP = {
    "span_block_m": [64],
    "span_block_n": [128],
    "span_warps": [8],
    "span_stages": [3],
    "span_block_m+span_block_n+span_warps": [(128, 128, 8), (64, 32, 4), (64, 64, 4), (64, 128, 4)],
    "span_block_m+span_stages": [(64, 3)],
    "gluon_forward": [False],
    "gluon_block_m+gluon_stages": [(64, 4), (64, 2), (128, 3)],
    "gluon_backward": [False],  # the Triton dK/dV and dQ entries below matter on sm_90 only with these False
    "gluon_query_grad": [False],
    "gluon_selected_backward": [False],
    "gluon_selected_forward": [False],
    "gluon_selected_forward_stages": [2, 4],
    "gluon_dkdv_stages": [2, 4],
    "gluon_dq_stages": [2, 4],
    "dq_block_m+dq_block_n+dq_warps": [(128, 64, 4), (64, 32, 4), (64, 128, 4), (64, 64, 8), (128, 64, 8)],
    "dq_block_n_tiled": [64],
    "cmp_rows_per_split": [4096, 16384, 65536],
    "dkdv_programs_per_sm": [2, 8],
    "dkdv_block_m": [32, 64],
    "dkdv_block_m_wide": [32],
    "dkdv_block_n": [128],
    "dkdv_warps": [8],
    "dkdv_stages": [3],
    "dkdv_block_n+dkdv_block_m+dkdv_warps+dkdv_stages": [(128, 32, 4, 3), (32, 128, 4, 2), (64, 64, 4, 3)],
    # Settings that spill fewer registers than the defaults on sm_90: the sweep shows whether that pays.
    "dkdv_block_n+dkdv_block_m+dkdv_warps": [(128, 64, 8), (64, 64, 8)],
    "sel_block_r": [32, 128],
    "sel_warps": [8],
    "sel_block_r+sel_warps": [(128, 8), (32, 8)],
    "sel_block_r_wide+sel_warps_wide": [(64, 4), (64, 8)],
    "row_block_m": [32, 128],
    "row_warps": [8],
    "inverse_chunk": [128, 512],
    "inverse_query_ranges": [1, 2, 8],
    "gate_block_m+gate_warps": [(16, 4), (64, 4), (128, 4), (128, 8)],
    "tiled_max_blocks": [0, 64],
    "tiled_max_blocks_forward": [0],
    "tiled_max_blocks_large_groups": [0, 32],
    "select_block_t": [8, 32],
    "select_warps": [2, 8],
    "branch_streams": [False],
}
"""Values tried for each launch parameter, or for several at once (names joined by '+', value tuples); the
defaults are measured too."""


def sweep(shape: str, T: int, batch: int = 1, params: list[str] | None = None) -> list[dict]:
    """Forward+backward time as each launch parameter (all of SWEEP, or `params`) varies around the defaults:
    one call at a time (fwd_ms, fwdbwd_ms), queued back to back (gpu_fwdbwd_ms, the GPU's share), as one CUDA-graph
    replay (graph_fwdbwd_ms: the GPU's time with the branches on their side stream at any size), and each stage's
    GPU time (components)."""
    from ..ops import tuning

    H, G, Dk, Dv = SHAPES[shape]
    ins = make_inputs(T, H, G, Dk, Dv, batch=batch)
    step = _fwd_bwd(_nsa(ins), ins)
    forward = _nsa(ins)

    def measure() -> dict:
        with torch.no_grad():
            fwd = _timed(forward)
        stages = {r["stage"]: r["ms"] for r in components(shape, T, batch)}
        replay = _graphed(step)
        return {"fwd_ms": fwd, "fwdbwd_ms": _timed(step), "gpu_fwdbwd_ms": _timed(step, queued=True),
                "graph_fwdbwd_ms": _timed(replay) if replay else None} | stages

    base = dataclasses.replace(tuning.TUNING)
    rows = [{"shape": shape, "T": T, "param": "defaults", "value": ""} | measure()]
    try:
        for key, values in SWEEP.items():
            if params and key not in params:
                continue
            fields = key.split("+")
            for value in values:
                setting = dict(zip(fields, value if len(fields) > 1 else (value,)))
                _set_tuning(tuning.TUNING, dataclasses.replace(base, **setting))
                try:
                    times = measure()
                except Exception as e:  # a variant that does not compile (e.g. out of shared memory)
                    times = {}
                    print(f"  {key}={value}: {type(e).__name__}")
                rows.append({"shape": shape, "T": T, "param": key, "value": str(value)} | times)
    finally:
        _set_tuning(tuning.TUNING, base)
    return rows


def _set_tuning(live, values) -> None:
    """Copy every launch parameter of `values` into the live Tuning object (the kernels' modules hold it)."""
    for f in dataclasses.fields(values):
        setattr(live, f.name, getattr(values, f.name))


# ------------------------------------------------------------------------------------------- packed documents

DOCUMENT_REFERENCES = ("unpacked", "flex", "flash", "cudnn", "fla")
"""What NSA on packed documents is timed against: NSA unpacked at the stream's length, then dense attention within
documents (FlexAttention, SDPA's varlen flash and cuDNN kernels) and fla-core's varlen parallel_nsa."""
SDPA_KERNELS = {"flash": "Flash attention", "cudnn": "cuDNN attention"}
"""How SDPA names the kernel of each varlen reference when it says why the kernel refused a call."""
ONE_DOCUMENT_LENGTHS = (8192, 65536)
"""Lengths at which one document packed is timed against the same tokens unpacked."""


def _nsa_packed(ins, cu: torch.Tensor):
    return lambda: nsa_attention(*ins, geometry=GEOMETRY, cu_seqlens=cu)


def _flex(ins, mixture: Mixture):
    """Compiled FlexAttention within documents over NSA's q and selected-branch keys and values ([1, heads, T, D],
    the key/value heads shared by each group as in the model), the block mask built beforehand."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (ins[0], ins[3], ins[4]))
    mask = document_block_mask(mixture, q.device)
    compiled = _compiled_flex_attention()

    def fwd():
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return fwd, [q, k, v]


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once (its fused kernel; eager FlexAttention materialises every score)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flash_varlen(ins, mixture: Mixture):
    """PyTorch's varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, flash-attn's varlen kernel) on
    the packed tokens, one causal sequence per document; without that module (PyTorch before 2.10), SDPA's flash
    kernel on nested jagged tensors. Key/value heads repeated over each group,
    as for the dense references."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return _varlen(ins, mixture, "flash")
    q, k, v = ins[0], ins[3], ins[4]
    h = q.shape[2] // k.shape[2]
    values = [q.detach()[0].contiguous().requires_grad_()]
    values += [t.detach()[0].repeat_interleave(h, 1).contiguous().requires_grad_() for t in (k, v)]
    offsets = cu_seqlens(mixture, q.device)
    longest = max(mixture.lengths)
    # Causality is a (left, 0) window in recent PyTorch, `is_causal` in the first releases with varlen_attn.
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
              else {"is_causal": True})

    def fwd():
        return varlen_attn(*values, offsets, offsets, longest, longest, **causal)

    return fwd, values


def _varlen(ins, mixture: Mixture, backend: str):
    """SDPA's `backend` kernel on nested jagged tensors, one causal sequence per document (the varlen kernels),
    key/value heads repeated over each group as for the dense references."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = ins[0], ins[3], ins[4]
    h = q.shape[2] // k.shape[2]
    values = [q.detach()[0].contiguous().requires_grad_()]
    values += [t.detach()[0].repeat_interleave(h, 1).contiguous().requires_grad_() for t in (k, v)]
    offsets = cu_seqlens(mixture, q.device).to(torch.int64)

    def fwd():
        with sdpa_kernel([chosen]):
            out = F.scaled_dot_product_attention(*(jagged(t, mixture, offsets) for t in values), is_causal=True)
        return out.transpose(1, 2).values()

    return fwd, values


def _measure(fn, graphs: bool, kernel: str = "") -> tuple[float | None, str | None]:
    """(ms, None), or (None, why) where a reference cannot run these inputs: its first call fails (no kernel for
    the dtype or shape, an op nested tensors lack; for SDPA, the reason its `kernel` gave, e.g. "Flash attention")
    or it runs out of memory."""
    told: list[str] = []
    try:
        with _refusals(told):
            fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "out of memory"
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, "; ".join([first, *refusal_of(told, kernel)[:2]])[:300]
    ms = _time_as(fn, graphs)
    return ms, None if ms is not None else ("out of memory or not captured" if graphs else "out of memory")


@contextlib.contextmanager
def _refusals(told: list[str]):
    """Collect into `told` the first line of every warning and of every message of SDPA's nested-tensor log: where
    SDPA refuses a call it says why there (the error names only "No available kernel" or "No viable backend")."""
    nested_log = logging.getLogger("torch.nested._internal.sdpa")

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            told.append(record.getMessage())

    handler = Collect()
    nested_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        nested_log.removeHandler(handler)
        told += [str(w.message) for w in caught]
        told[:] = [m.strip().splitlines()[0] for m in told if m.strip()]


def refusal_of(told: list[str], kernel: str) -> list[str]:
    """The reasons SDPA gave for not running `kernel`: it lists each kernel's under a header "<kernel> ... not
    used because:"; without such a header (or kernel), every line that is not a header."""
    sections: dict[str, list[str]] = {}
    header = ""
    for line in told:
        if line.endswith("because:"):
            header = line
        else:
            sections.setdefault(header, []).append(line)
    chosen = [lines for h, lines in sections.items() if kernel and h.lower().startswith(kernel.lower())]
    return chosen[0] if chosen else [line for lines in sections.values() for line in lines]


def compare_documents(shape: str, mixture: Mixture, backward: bool, use_fla: bool, graphs: bool = False) -> dict:
    """One row: NSA on the packed mixture and every reference of DOCUMENT_REFERENCES, forward and (backward)
    forward+backward; `X_KIND_ms` is 'n/a' where X cannot run (the reason in `not_run`), `vs_X_KIND` = X / NSA."""
    H, G, Dk, Dv = SHAPES[shape]
    row = {"shape": f"{shape} {H}/{G}/{Dk}", "docs": mixture.spec, "n": len(mixture.lengths), "T": mixture.total}
    try:
        ins = make_inputs(mixture.total, H, G, Dk, Dv)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return row
    cu = cu_seqlens(mixture, "cuda")
    fla = _fla(ins, cu.to(torch.int64)) if use_fla else None
    calls = {"unpacked": (_nsa(ins), ins), "flex": _flex(ins, mixture), "flash": _flash_varlen(ins, mixture),
             "cudnn": _varlen(ins, mixture, "cudnn"), "fla": fla}
    reasons, kinds = [], ("fwd", "fwdbwd") if backward else ("fwd",)
    for kind in kinds:
        step = (lambda fwd, tensors: fwd) if kind == "fwd" else _fwd_bwd
        with torch.set_grad_enabled(kind == "fwdbwd"):
            row[f"nsa_{kind}_ms"] = _time_as(step(_nsa_packed(ins, cu), ins), graphs)
            for who, call in calls.items():
                if call is None:  # fla-core not installed, or refusing this shape
                    continue
                ms, why = _measure(step(*call), graphs, SDPA_KERNELS.get(who, ""))
                row[f"{who}_{kind}_ms"] = "n/a" if why else ms
                if why:
                    reasons.append(f"{who} {kind}: {why}")
    for kind in kinds:
        nsa = row.get(f"nsa_{kind}_ms")
        for who in DOCUMENT_REFERENCES:
            other = row.get(f"{who}_{kind}_ms")
            row[f"vs_{who}_{kind}"] = other if other == "n/a" else other / nsa if other and nsa else None
    row["not_run"] = " | ".join(reasons)
    del ins, calls, fla
    torch.cuda.empty_cache()
    return row


def one_document(shape: str, T: int, backward: bool, graphs: bool = False) -> dict:
    """NSA on one document of T tokens through the packed path against the same inputs unpacked;
    `packed_vs_unpacked_KIND` = unpacked / packed time (1 when packing costs nothing)."""
    H, G, Dk, Dv = SHAPES[shape]
    row = {"shape": f"{shape} {H}/{G}/{Dk}", "T": T}
    ins = make_inputs(T, H, G, Dk, Dv)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    for kind in ("fwd", "fwdbwd") if backward else ("fwd",):
        with torch.set_grad_enabled(kind == "fwdbwd"):
            calls = {"unpacked": _nsa(ins), "packed": _nsa_packed(ins, cu)}
            for who, fwd in calls.items():
                row[f"{who}_{kind}_ms"] = _time_as(fwd if kind == "fwd" else _fwd_bwd(fwd, ins), graphs)
        packed, unpacked = row[f"packed_{kind}_ms"], row[f"unpacked_{kind}_ms"]
        row[f"packed_vs_unpacked_{kind}"] = unpacked / packed if packed and unpacked else None
    del ins
    torch.cuda.empty_cache()
    return row


DOCUMENT_COLUMNS = ["shape", "docs", "n", "nsa_fwd_ms", *(f"vs_{who}_fwd" for who in DOCUMENT_REFERENCES),
                    "nsa_fwdbwd_ms", *(f"vs_{who}_fwdbwd" for who in DOCUMENT_REFERENCES)]
"""The printed table of compare_documents (the files hold every time too)."""


def run_documents(shapes: list[str], mixtures: list[Mixture], out_dir: str, meta: dict, backward: bool,
                  use_fla: bool, graphs: bool) -> tuple[Path, ...]:
    """Every mixture at every shape, then one document packed against unpacked; prints both tables and writes
    attention_docs.{csv,json} and attention_one_document.{csv,json}, each mixture's lengths in the environment."""
    meta = meta | {"mixtures": {m.spec: list(m.lengths) for m in mixtures}}
    rows, paths = [], ()
    for shape in shapes:
        for mixture in mixtures:
            rows.append(compare_documents(shape, mixture, backward, use_fla, graphs))
            print_row(rows[-1], [c for c in DOCUMENT_COLUMNS if c in rows[-1]])
            paths = write_results(rows, out_dir, "attention_docs", meta)
    print("\n" + format_table(rows, [c for c in DOCUMENT_COLUMNS if any(c in r for r in rows)]))
    for note in (f"{r['shape']} {r['docs']}: {r['not_run']}" for r in rows if r.get("not_run")):
        print(f"  n/a  {note}")
    single = [one_document(shape, T, backward, graphs) for shape in shapes for T in ONE_DOCUMENT_LENGTHS]
    print("\none document, packed against unpacked (unpacked / packed time):")
    print(format_table(single, list(dict.fromkeys(k for r in single for k in r))))
    return paths + write_results(single, out_dir, "attention_one_document", meta)


def run(shapes: list[str], lengths: list[int], out_dir: str, backward: bool = True, use_fla: bool = True,
        breakdown_at: list[int] | None = None, sweep_at: list[int] | None = None, batch: int = 1,
        sweep_params: list[str] | None = None, graphs: bool = False, docs: str | None = None) -> list[dict]:
    """The tables of compare at every shape and length (then components, sweep), and with `docs` (comma-separated
    mixtures, nsa.bench.mixtures) those of run_documents; returns compare's rows."""
    mixtures = parse_mixtures(docs) if docs is not None else []
    if not torch.cuda.is_available():
        raise UserError("nsa bench attention needs a CUDA GPU")
    if batch < 1:
        raise UserError(f"--batch must be at least 1, got {batch}")
    unknown_params = [p for p in sweep_params or [] if p not in SWEEP]
    if unknown_params:
        raise UserError(f"unknown sweep parameter(s) {unknown_params}; choose from {', '.join(SWEEP)}")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise UserError(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    meta = environment() | {"hyperparameters": dataclasses.asdict(GEOMETRY), "dtype": "bfloat16", "batch": batch,
                            "cuda_graphs": graphs, "shapes": {s: SHAPES[s] for s in shapes}}
    print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}  git {meta['git']}")
    rows, paths = [], ()
    for shape in shapes:
        for T in lengths:
            rows.append(compare(shape, T, backward, use_fla, batch, graphs))
            print_row(rows[-1], list(rows[-1]))
            paths = write_results(rows, out_dir, "attention", meta)  # so far: a run cut short keeps its rows
    columns = ["shape", "T", "nsa_fwd_ms", "dense_fwd_ms", "cudnn_fwd_ms", "fla_fwd_ms", "speedup_fwd", "vs_cudnn_fwd",
               "nsa_fwdbwd_ms", "dense_fwdbwd_ms", "cudnn_fwdbwd_ms", "fla_fwdbwd_ms", "speedup_fwdbwd",
               "vs_cudnn_fwdbwd", "vs_fla_fwdbwd", "nsa_host_fwd_ms", "dense_host_fwd_ms", "nsa_host_fwdbwd_ms"]
    if rows:
        print("\n" + format_table(rows, [c for c in columns if any(c in r for r in rows)]))
        paths += picture(rows, meta, Path(out_dir) / "attention.png")
    if mixtures:
        paths += run_documents(shapes, mixtures, out_dir, meta, backward, use_fla, graphs)
    for T in breakdown_at or []:
        parts = [r for shape in shapes for r in components(shape, T, batch)]
        print("\n" + format_table(parts, ["shape", "T", "stage", "ms"]))
        paths += write_results(parts, out_dir, f"attention_components_{T}", meta)
    if sweep_at:
        tuned = [r for T in sweep_at for shape in shapes for r in sweep(shape, T, batch, sweep_params)]
        print("\n" + format_table(tuned, list(dict.fromkeys(k for r in tuned for k in r))))
        paths += write_results(tuned, out_dir, "attention_sweep", meta)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return rows
