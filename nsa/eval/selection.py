"""Does NSA's selection bring the needle in? For a retrieval example, the blocks that each layer's kv
groups select at the queries of the question (up to the one predicting the answer's first token), checked
against the blocks that hold the needle.

A retrieval miss then reads as one of two failures: no query of the question chose the needle's block (the
compressed branch's scores did not rank it in the top n), or one did and the model still did not copy the
answer. Every query of the question counts, not only the last: a model can fetch the key at the question's
first words and carry it forward, so a model may answer correctly while few layers select the needle at the
last query. Forced blocks count as selected (block 0, and the query's own block
and the one before it), so needles at depth 0 or right before the question are always selected.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from ..model.attention import NSAAttention


def nsa_layers(model: nn.Module) -> list[NSAAttention]:
    """The model's NSA attention modules, in layer order (empty for a dense model)."""
    return [layer.attn for layer in getattr(model, "layers", []) if isinstance(layer.attn, NSAAttention)]


@dataclass
class QuestionRecord:
    """What each NSA layer did at the queries of the question, one entry per layer in layer order."""

    blocks: list[torch.Tensor] = field(default_factory=list)
    """[B,P,G,n] selected blocks at the recorded queries (-1 marks unused slots)."""
    gates: list[torch.Tensor] = field(default_factory=list)
    """[B,3] gates (cmp, sel, win), mean over the recorded queries and the heads: whether the layer used its
    branches where the answer is fetched (the trainer's gate statistics average over every token instead)."""


@contextlib.contextmanager
def record_selection(model: nn.Module, query_pos: torch.Tensor) -> Iterator[QuestionRecord]:
    """While active, each NSA layer's forward records its selected blocks and gates at positions query_pos [B,P].

    The selection is recomputed from the layer's own inputs (NSAAttention.selected_blocks, the op the
    layer's attention uses), so it is exactly what the forward attended to. Costs one more projection and
    selection per layer.
    """
    record = QuestionRecord()
    hooks = [attn.register_forward_hook(partial(_record, record=record, query_pos=query_pos))
             for attn in nsa_layers(model)]
    try:
        yield record
    finally:
        for hook in hooks:
            hook.remove()


def _record(attn: NSAAttention, inputs: tuple, output: torch.Tensor, *, record: QuestionRecord,
            query_pos: torch.Tensor):
    projected = attn.project(*inputs)
    idx = attn.selected_blocks(projected)  # [B,T,G,n]
    rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
    record.blocks.append(idx[rows, query_pos])
    record.gates.append(projected["gates"][rows, query_pos].float().mean(dim=(1, 2)))  # [B,P,H,3] -> [B,3]


def needle_selected(selected: list[torch.Tensor], needle_start: torch.Tensor, needle_len: torch.Tensor,
                    sel_block: int) -> torch.Tensor:
    """bool [B,L,G]: layer L's kv group G selected a block overlapping the needle of each row (at any of the
    recorded queries).

    selected: one [B,P,G,n] per layer (record_selection's records; -1 marks unused slots); the needle of row
    b covers tokens [needle_start[b], needle_start[b] + needle_len[b]).
    """
    blocks = torch.stack(selected, 1)  # [B,L,P,G,n]
    first = (needle_start // sel_block).view(-1, 1, 1, 1, 1)
    last = ((needle_start + needle_len - 1) // sel_block).view(-1, 1, 1, 1, 1)
    return ((blocks >= first) & (blocks <= last)).any(-1).any(2)
