"""Argument checks for the public NSA ops: one ValueError naming the tensor and the rule.

The hyper-parameters' rules are NSAGeometry's, checked when the geometry is built; these check the tensors
against it.
"""

from __future__ import annotations

import torch

from .geometry import NSAGeometry


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def check_select_inputs(q: torch.Tensor, k_cmp: torch.Tensor, geometry: NSAGeometry,
                        cu_seqlens: torch.Tensor | None = None) -> None:
    """q [B,T,H,Dk] and k_cmp [B,Nc,G,Dk] with Nc compressed blocks of T tokens and G dividing H; with cu_seqlens,
    q [1,total,H,Dk] and k_cmp [1,C,G,Dk] with C at least the packed documents' compressed tokens (Nc(total) rows
    always suffice, which is what is checked without reading cu_seqlens' values)."""
    if q.dim() != 4 or k_cmp.dim() != 4:
        raise ValueError(f"q must be [B,T,H,Dk] and k_cmp [B,Nc,G,Dk]; got q {_shape(q)}, k_cmp {_shape(k_cmp)}")
    batch, seq_len, heads, dk = q.shape
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q)
    expected_nc = geometry.num_compressed_blocks(seq_len)
    rows_ok = k_cmp.shape[1] == expected_nc if cu_seqlens is None else k_cmp.shape[1] >= expected_nc
    if k_cmp.shape[0] != batch or not rows_ok or k_cmp.shape[3] != dk:
        rows = f"Nc={expected_nc}" if cu_seqlens is None else f"Nc>={expected_nc}"
        raise ValueError(
            f"k_cmp must be [B={batch}, {rows}, G, Dk={dk}] for T={seq_len}, l={geometry.block_len}, "
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
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Every tensor of nsa_attention shaped to match q and k_cmp, all on one device."""
    check_select_inputs(q, k_cmp, geometry, cu_seqlens)
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


def check_cu_seqlens(cu_seqlens: torch.Tensor, q: torch.Tensor) -> None:
    """cu_seqlens: int32 [N+1] on q's device, for q of batch 1 (the packed layout). Its values are not read here
    (that would wait for the GPU): the reference checks them when it splits the documents."""
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, q must hold one packed sequence [1, total, H, Dk]; got {_shape(q)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be a 1-d int32 tensor of at least 2 boundaries (flash-attn's varlen "
                         f"convention); got {_shape(cu_seqlens)} {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device ({q.device}); got {cu_seqlens.device}")


def document_bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of the non-empty documents cut by cu_seqlens, after checking its values: 0 first, never
    decreasing, `total` last (reads the values: a host sync)."""
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the {total} packed tokens; got "
                         f"{values[:3]} ... {values[-2:]}")
    return [(a, b) for a, b in zip(values, values[1:]) if b > a]
