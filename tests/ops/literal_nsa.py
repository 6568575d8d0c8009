"""A literal, loop-per-query transcription of the NSA contract (docs/design.md), written independently of
nsa.ops.reference (no shared helpers) so that the two can check each other. Tiny shapes only."""

from __future__ import annotations

import math

import torch


def _softmax_attend(q, keys, values, scale):
    """q [D], keys [S,D], values [S,Dv] -> [Dv]; zeros when S == 0."""
    if keys.shape[0] == 0:
        return torch.zeros(values.shape[-1], dtype=q.dtype)
    p = torch.softmax((keys @ q) * scale, dim=0)
    return p @ values


def literal_selection(q, k_cmp, *, block_len, block_stride, sel_block, n_sel, scale=None):
    """(indices [B,T,G,n] as sorted lists padded with -1, scores [B,T,G,Ns])."""
    B, T, H, Dk = q.shape
    G, Nc = k_cmp.shape[2], k_cmp.shape[1]
    h = H // G
    Ns = math.ceil(T / sel_block)
    scale = Dk**-0.5 if scale is None else scale
    scores = torch.zeros(B, T, G, Ns, dtype=torch.float64)
    indices = torch.full((B, T, G, n_sel), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            visible = [i for i in range(Nc) if i * block_stride + block_len - 1 <= t]
            for head in range(H):
                g = head // h
                if not visible:
                    continue
                logits = torch.stack([scale * (q[b, t, head].double() @ k_cmp[b, i, g].double()) for i in visible])
                p = torch.softmax(logits, 0)
                for pi, i in zip(p, visible):
                    lo_i, hi_i = i * block_stride, i * block_stride + block_len
                    for j in range(Ns):
                        lo, hi = max(lo_i, j * sel_block), min(hi_i, (j + 1) * sel_block)
                        if hi > lo:
                            scores[b, t, g, j] += pi * (hi - lo) / block_stride
            jt = t // sel_block
            for g in range(G):
                candidates = list(range(jt + 1))
                forced = sorted({0, jt} | ({jt - 1} if jt >= 1 else set()))
                rest = sorted((j for j in candidates if j not in forced), key=lambda j: (-scores[b, t, g, j].item(), j))
                chosen = sorted(forced + rest[: max(0, n_sel - len(forced))])
                indices[b, t, g, : len(chosen)] = torch.tensor(chosen)
    return indices, scores


def literal_nsa(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_len, block_stride, sel_block,
                n_sel, window, scale=None):
    """Output [B,T,H,Dv] (differentiable through torch autograd) and the selected indices."""
    B, T, H, Dk = q.shape
    G = k_cmp.shape[2]
    h = H // G
    scale = Dk**-0.5 if scale is None else scale
    indices, _ = literal_selection(
        q.detach(), k_cmp.detach(), block_len=block_len, block_stride=block_stride, sel_block=sel_block,
        n_sel=n_sel, scale=scale,
    )
    rows = []
    for b in range(B):
        for t in range(T):
            for head in range(H):
                g = head // h
                vis = [i for i in range(k_cmp.shape[1]) if i * block_stride + block_len - 1 <= t]
                o_cmp = _softmax_attend(q[b, t, head], k_cmp[b, vis, g], v_cmp[b, vis, g], scale)
                chosen = {int(j) for j in indices[b, t, g] if j >= 0}
                sel_keys = [s for s in range(t + 1) if s // sel_block in chosen]
                o_sel = _softmax_attend(q[b, t, head], k_sel[b, sel_keys, g], v_sel[b, sel_keys, g], scale)
                win_keys = list(range(max(0, t - window + 1), t + 1))
                o_win = _softmax_attend(q[b, t, head], k_win[b, win_keys, g], v_win[b, win_keys, g], scale)
                gt = gates[b, t, head]
                rows.append(gt[0] * o_cmp + gt[1] * o_sel + gt[2] * o_win)
    out = torch.stack(rows).view(B, T, H, -1)
    return out, indices
