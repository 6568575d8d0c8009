"""Argument checks for the public NSA ops: one ValueError naming the tensor and the rule."""

from __future__ import annotations

import torch

from .geometry import check_hyperparameters, num_compressed_blocks


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def check_select_inputs(
    q: torch.Tensor, k_cmp: torch.Tensor, *, block_len: int, block_stride: int, sel_block: int, n_sel: int
) -> None:
    check_hyperparameters(block_len, block_stride, sel_block, n_sel)
    if q.dim() != 4 or k_cmp.dim() != 4:
        raise ValueError(f"q must be [B,T,H,Dk] and k_cmp [B,Nc,G,Dk]; got q {_shape(q)}, k_cmp {_shape(k_cmp)}")
    batch, seq_len, heads, dk = q.shape
    expected_nc = num_compressed_blocks(seq_len, block_len, block_stride)
    if k_cmp.shape[0] != batch or k_cmp.shape[1] != expected_nc or k_cmp.shape[3] != dk:
        raise ValueError(
            f"k_cmp must be [B={batch}, Nc={expected_nc}, G, Dk={dk}] for T={seq_len}, l={block_len}, "
            f"d={block_stride}; got {_shape(k_cmp)}"
        )
    groups = k_cmp.shape[2]
    if groups < 1 or heads % groups:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value groups ({groups})")


def check_nsa_inputs(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block: int,
    n_sel: int,
    window: int,
) -> None:
    check_select_inputs(q, k_cmp, block_len=block_len, block_stride=block_stride, sel_block=sel_block, n_sel=n_sel)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    batch, seq_len, heads, dk = q.shape
    groups, num_cmp = k_cmp.shape[2], k_cmp.shape[1]
    dv = v_sel.shape[-1] if v_sel.dim() == 4 else -1
    expected = {
        "v_cmp": (batch, num_cmp, groups, dv),
        "k_sel": (batch, seq_len, groups, dk),
        "v_sel": (batch, seq_len, groups, dv),
        "k_win": (batch, seq_len, groups, dk),
        "v_win": (batch, seq_len, groups, dv),
        "gates": (batch, seq_len, heads, 3),
    }
    given = {"v_cmp": v_cmp, "k_sel": k_sel, "v_sel": v_sel, "k_win": k_win, "v_win": v_win, "gates": gates}
    for name, tensor in given.items():
        if tuple(tensor.shape) != expected[name]:
            want = "[" + ",".join(str(s) for s in expected[name]) + "]"
            raise ValueError(f"{name} must have shape {want} to match q {_shape(q)} and k_cmp; got {_shape(tensor)}")
    devices = {t.device for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(str(d) for d in devices)}")
