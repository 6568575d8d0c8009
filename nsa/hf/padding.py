"""Padded batches (an attention_mask with zeros) as packed documents: each row's tokens back to back, each row its
own document at positions from 0 (docs/design.md#packed-documents), so that every row computes as it would alone,
whichever side its padding is on."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PackedRows:
    """The real tokens of a padded batch [B,T], packed."""

    tokens: torch.Tensor
    """[1, total]: each row's real tokens, row after row."""
    cu_seqlens: torch.Tensor
    """int32 [B + 1]: where each row's tokens start and end in `tokens`."""
    real: torch.Tensor
    """bool [B, T]: where the real (not padding) tokens are."""

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] of a packed result [1, total, ...]: each row's values at its tokens, zeros at the padding."""
        out = packed.new_zeros(*self.real.shape, *packed.shape[2:])
        out[self.real] = packed[0]  # boolean indexing runs row after row, as the packing did
        return out


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> PackedRows | None:
    """The packed rows of a padded batch; None when nothing is padding (no mask, or all ones). Padding must be at
    the start or the end of a row (one run of ones per row: left or right padding)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    real = attention_mask.bool()
    runs = (real[:, 1:] & ~real[:, :-1]).sum(1) + real[:, 0].long()
    if real.shape != input_ids.shape or bool((runs != 1).any()):
        raise ValueError(f"attention_mask {list(attention_mask.shape)} does not pad input_ids "
                         f"{list(input_ids.shape)} at the start or the end of each row; NSAForCausalLM takes left or "
                         "right padding, each row holding at least one token")
    cu_seqlens = F.pad(real.sum(1).cumsum(0), (1, 0)).to(torch.int32)
    return PackedRows(input_ids[real][None], cu_seqlens, real)


def next_token_targets(labels: torch.Tensor, rows: PackedRows | None) -> torch.Tensor:
    """labels[:, 1:] as the targets of positions 0..T-2, -100 (ignored) where the position or its target is padding."""
    targets = labels[:, 1:]
    if rows is None:
        return targets
    return targets.masked_fill(~(rows.real[:, :-1] & rows.real[:, 1:]), -100)
