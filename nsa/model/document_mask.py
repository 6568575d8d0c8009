"""FlexAttention's BlockMask for causal attention within packed documents, built from the documents' starts.

The mask's block structure follows from where documents start, so it is computed directly (a few [B, n, n]
comparisons for n = ceil(T / 128) blocks) instead of by evaluating the mask at every (query, key) pair as
`create_block_mask` does. It is built once per forward, outside any compiled region, and every layer reads it:
the compiled blocks receive a finished BlockMask, so Inductor never fuses the mask's construction into the
attention kernel itself. Shapes depend on B and T only, so the mask is static under torch.compile and CUDA graphs.

For query block i of row b (tokens i*128 .. i*128+127), with s_first and s_last the starts of the documents of
its first and last token:
- key blocks from s_first // 128 to i may hold keys some query of the block sees (every document between the
  first and the last query's lies inside block i); all others are skipped;
- when the block lies in one document (s_first == s_last), the key blocks from ceil(s_first / 128) to i - 1 are
  seen whole by every query ("full": no mask evaluated); the diagonal block and a block holding the document's
  start are partial, where FlexAttention evaluates the mask per pair.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

FLEX_BLOCK = 128
"""FlexAttention's default block size, in tokens (queries and keys)."""


def causal_within_documents(ids: torch.Tensor):
    """The mask_mod of causal attention within documents: key kv is seen by query q of row b when kv <= q and both
    lie in one document (ids [B, T]: each token's document)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (ids[b, q] == ids[b, kv])

    return mask_mod


def document_block_mask(ids: torch.Tensor, positions: torch.Tensor) -> BlockMask:
    """The BlockMask of causal attention within documents for a batch [B, T]: ids [B, T] each token's document,
    positions [B, T] each token's position in its document (nsa.model.documents.Documents)."""
    b, t = ids.shape
    n = -(-t // FLEX_BLOCK)
    blocks = torch.arange(n, device=ids.device)
    starts = torch.arange(t, device=ids.device) - positions  # [B, T] each token's document start in its row
    s_first = starts[:, blocks * FLEX_BLOCK]  # [B, n]
    s_last = starts[:, torch.clamp(blocks * FLEX_BLOCK + FLEX_BLOCK - 1, max=t - 1)]
    query, key = blocks[None, :, None], blocks[None, None, :]  # [1, n, 1] and [1, 1, n]
    seen = (key >= (s_first // FLEX_BLOCK)[..., None]) & (key <= query)
    first_whole = (-(-s_last // FLEX_BLOCK))[..., None]  # the first block that starts inside the last document
    full = (s_first == s_last)[..., None] & (key >= first_whole) & (key < query)
    partial = seen & ~full
    kv_num, kv_idx = _listed(partial, n)
    full_num, full_idx = _listed(full, n)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=causal_within_documents(ids), seq_lengths=(t, t))


def _listed(flags: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flags [B, n, n] (query block, key block) as BlockMask reads them: counts [B, 1, n] and, per query block,
    the flagged key blocks first in ascending order, [B, 1, n, n] int32."""
    key = torch.arange(n, device=flags.device)
    order = torch.argsort(torch.where(flags, key, key + n), dim=-1)
    return flags.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]
