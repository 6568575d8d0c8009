"""Selection distillation: a training-only term that teaches the compressed scores where to look.

NSA's top-n picks blocks by the compressed branch's attention probabilities (docs/design.md#top-n-selection), and
top-n has no gradient: the scores learn only through the compressed branch's output, scaled by its gate. A layer
that copies through its selected branch and gives its compressed branch a small gate therefore barely trains its
selection. This term gives the scores a direct signal, as DeepSeek-V3.2 trains its sparse attention's indexer: a
KL divergence from where the selected branch's own queries and keys would attend over the whole context (the
teacher, without gradient) to the block scores top-n ranks (the student). It is computed at the last few queries
of each sequence only, so its cost is that of a few rows of dense attention.
"""

from __future__ import annotations

import torch

from ..ops.geometry import NSAGeometry, num_compressed_blocks, num_selection_blocks, overlap_matrix
from ..ops.reference import block_scores


def selection_distillation(q: torch.Tensor, k_cmp: torch.Tensor, k_sel: torch.Tensor, geometry: NSAGeometry,
                           queries: int) -> torch.Tensor:
    """KL(teacher || student), a float32 scalar, averaged over batch rows, kv groups and the last `queries`
    positions of each sequence that have a block to choose.

    q [B,T,H,D] (RoPE'd queries), k_cmp [B,Nc,G,D] (compressed keys), k_sel [B,T,G,D] (the selected branch's
    RoPE'd keys). For a query at t, over the candidate blocks that top-n ranks (1 <= j <= t // l' - 2: the forced
    blocks, 0, t's own and the one before, are taken anyway):
    - teacher: each block's share of the softmax of q . k_sel over every key s <= t, averaged over the group's
      heads; no gradient;
    - student: the Eq. 9 block scores (p_cmp mapped onto selection blocks, summed over the group's heads);
      its gradient reaches q and k_cmp.
    Both are renormalised over the candidates. Queries with fewer than two candidates (where the term is zero) are
    left out of the mean; zero, without gradient, where no query has two.
    """
    total, count = selection_kl_sum(q, k_cmp, k_sel, geometry, queries)
    return total / count if count else total


@torch.compiler.disable  # reads the documents' lengths on the host
def packed_selection_distillation(q: torch.Tensor, k_cmp: torch.Tensor, k_sel: torch.Tensor, geometry: NSAGeometry,
                                  queries: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """selection_distillation of a packed stream, each document its own sequence: q [1,N,H,D], k_sel [1,N,G,D],
    k_cmp [1,Nc,G,D] laid out by compressed_offsets, documents cut by cu_seqlens [D+1]; averaged over every
    document's terms. Consecutive documents of one length are computed as one batch of views (a retrieval batch
    is B documents of one length)."""
    bounds = cu_seqlens.tolist()
    # Where each document's compressed rows start (compressed_offsets), from the lengths already on the host.
    offsets = [0]
    for start, end in zip(bounds[:-1], bounds[1:]):
        offsets.append(offsets[-1] + num_compressed_blocks(end - start, geometry.block_len, geometry.block_stride))
    total, count = torch.zeros((), device=q.device), 0
    for first, docs, length in _equal_length_runs(bounds):
        num_cmp = num_compressed_blocks(length, geometry.block_len, geometry.block_stride)
        tokens = slice(bounds[first], bounds[first] + docs * length)
        rows = slice(offsets[first], offsets[first] + docs * num_cmp)
        part, n = selection_kl_sum(q[0, tokens].reshape(docs, length, *q.shape[2:]),
                          k_cmp[0, rows].reshape(docs, num_cmp, *k_cmp.shape[2:]),
                          k_sel[0, tokens].reshape(docs, length, *k_sel.shape[2:]), geometry, queries)
        total, count = total + part, count + n
    return total / count if count else total


def _equal_length_runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """(first document, documents, length) of each run of consecutive non-empty documents of one length: their
    tokens, and their compressed rows, are contiguous, so a run is one batch of views."""
    runs: list[tuple[int, int, int]] = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue  # an empty document holds no token and no compressed row: the run goes on past it
        if runs and runs[-1][2] == end - start and bounds[runs[-1][0]] + runs[-1][1] * runs[-1][2] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, end - start)
        else:
            runs.append((i, 1, end - start))
    return runs


def selection_kl_sum(q: torch.Tensor, k_cmp: torch.Tensor, k_sel: torch.Tensor, geometry: NSAGeometry,
                     queries: int) -> tuple[torch.Tensor, int]:
    """(sum of the KL terms, a float32 tensor, and their number) of selection_distillation, without a host sync:
    the health statistics add them over layers and ranks."""
    b, t, h, d = q.shape
    groups, num_cmp = k_cmp.shape[2], k_cmp.shape[1]
    rows = min(queries, t)
    positions = torch.arange(t - rows, t, device=q.device)  # [R]
    num_sel = num_selection_blocks(t, geometry.sel_block)
    blocks = torch.arange(num_sel, device=q.device)
    # Host values, from t and the geometry alone: the queries with two candidates or more (with one, teacher and
    # student are both 1 on it: the term and its gradient are zero).
    has_candidate = [(p // geometry.sel_block) - 2 >= 2 for p in range(t - rows, t)]
    if num_cmp == 0 or not any(has_candidate):
        return torch.zeros((), device=q.device), 0
    candidate = (blocks >= 1) & (blocks <= (positions // geometry.sel_block)[:, None] - 2)  # [R, Ns]
    scale = d ** -0.5
    q_last = q[:, t - rows:].float()  # [B,R,H,D]
    teacher = _teacher(q_last.reshape(b, rows, groups, h // groups, d), k_sel, positions, geometry.sel_block, num_sel,
                       scale)
    weights = overlap_matrix(num_cmp, num_sel, geometry.block_len, geometry.block_stride, geometry.sel_block,
                             device=q.device)
    student = block_scores(q_last, k_cmp.float(), t - rows, weights, block_len=geometry.block_len,
                           block_stride=geometry.block_stride, scale=scale)
    teacher, student = _over(teacher, candidate), _over(student, candidate)
    tiny = torch.finfo(torch.float32).tiny
    kl = (teacher * (teacher.clamp_min(tiny).log() - student.clamp_min(tiny).log())).sum(-1)  # [B,R,G]
    valid = (positions // geometry.sel_block - 2 >= 2).to(kl.dtype)  # has_candidate, built on the device
    return (kl * valid[None, :, None]).sum(), b * groups * sum(has_candidate)


@torch.no_grad()
def _teacher(q_rows: torch.Tensor, k_sel: torch.Tensor, positions: torch.Tensor, sel_block: int, num_sel: int,
             scale: float) -> torch.Tensor:
    """[B,R,G,Ns]: each selection block's share of the causal softmax of q . k_sel, averaged over the heads."""
    b, rows, groups, heads, _ = q_rows.shape
    t = k_sel.shape[1]
    scores = torch.einsum("brghd,bsgd->brghs", q_rows, k_sel.float()) * scale
    causal = torch.arange(t, device=q_rows.device) <= positions[:, None]  # [R, T]
    probs = scores.masked_fill(~causal[None, :, None, None], float("-inf")).softmax(-1)
    padded = torch.nn.functional.pad(probs, (0, num_sel * sel_block - t))
    return padded.view(b, rows, groups, heads, num_sel, sel_block).sum(-1).mean(3)


def _over(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """scores [B,R,G,Ns] kept on the candidates [R,Ns] and normalised to sum to 1 (rows without any: zeros)."""
    kept = torch.where(candidate[None, :, None], scores, torch.zeros_like(scores))
    total = kept.sum(-1, keepdim=True)
    return kept / torch.where(total > 0, total, torch.ones_like(total))


class _WithAuxiliaryLoss(torch.autograd.Function):
    """Identity on `output` whose backward also sends gradient 1 into `loss`: loss's gradient joins the step's
    without entering the reported loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def with_auxiliary_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged; a backward through it also back-propagates `loss` (a scalar) as if added to the loss."""
    if not loss.requires_grad:
        return output
    return _WithAuxiliaryLoss.apply(output, loss)
