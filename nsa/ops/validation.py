"""Argument checks for the public NSA ops: one ValueError naming the tensor and the rule.

The hyper-parameters' rules are NSAGeometry's, checked when the geometry is built; these check the tensors
against it.
"""

from __future__ import annotations

import torch

from .geometry import NSAGeometry


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def check_select_inputs(q: torch.Tensor, k_cmp: torch.Tensor, geometry: NSAGeometry) -> None:
    """q [B,T,H,Dk] and k_cmp [B,Nc,G,Dk] with Nc compressed blocks of T tokens and G dividing H."""
    if q.dim() != 4 or k_cmp.dim() != 4:
        raise ValueError(f"q must be [B,T,H,Dk] and k_cmp [B,Nc,G,Dk]; got q {_shape(q)}, k_cmp {_shape(k_cmp)}")
    batch, seq_len, heads, dk = q.shape
    expected_nc = geometry.num_compressed_blocks(seq_len)
    if k_cmp.shape[0] != batch or k_cmp.shape[1] != expected_nc or k_cmp.shape[3] != dk:
        raise ValueError(
            f"k_cmp must be [B={batch}, Nc={expected_nc}, G, Dk={dk}] for T={seq_len}, l={geometry.block_len}, "
            f"d={geometry.block_stride}; got {_shape(k_cmp)}"
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
    geometry: NSAGeometry,
) -> None:
    """Every tensor of nsa_attention shaped to match q and k_cmp, all on one device."""
    check_select_inputs(q, k_cmp, geometry)
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
