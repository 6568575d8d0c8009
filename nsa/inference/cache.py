"""Decode caches: per-layer state preallocated for a maximum length, so every shape is static.

An NSA layer keeps each branch's own state (docs/design.md#decoding):
- `k`, `v` [S,B,L,G,D]: the raw RoPE'd keys and the values of each of the layer's S key/value
  sets (S = NSAAttention.n_kv_sets: 3 = one per branch in (cmp, sel, win) order, 1 = shared_kv).
  Branch c reads set c % S, exactly as NSAAttention.project assigns them. The selection may pick
  any earlier block, so the raw stream is kept whole; the window and the compressor read
  contiguous slices of it (no ring buffer: a slice stays a slice for a kernel, and prompts of
  different lengths need no special care).
- `k_cmp`, `v_cmp` [B,Nc_max,G,D]: the compressed stream, `n_cmp` [B] tokens of it emitted.
- `sel_index`, `sel_weight` [Nc_max,K]: the Eq. 9 overlaps as a band (compressed token i touches
  at most K selection blocks), so selection scores cost O(Nc) per query instead of O(Nc*Ns).
- `selected` [B,G,n] and `reads` [B,G]: what the last decode step chose and read (telemetry, tests).
- `fused`: the layer's weights stacked for fewer matmuls per step (nsa.inference.fused), a snapshot.

A dense layer keeps one plain `k`, `v` [B,L,G,D] and its own `fused` input weights.

A prefill fills sequence b from B prompts of one length [B,T], or from B packed prompts of any lengths (one
document each, docs/design.md#packed-documents): the raw stream at the document's own positions, and the
document's own compressed tokens (its rows of the packed k_cmp, from compressed_offsets). Positions beyond a
sequence's length may hold stale values; every reader masks by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..model.attention import BRANCHES, NSAAttention
from ..model.documents import Documents
from ..ops.geometry import NSAGeometry, compressed_offsets
from .fused import FusedWeights, compress_pair, fuse


def _rows(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.shape[0], device=t.device)


def _slots(documents: Documents) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each token of a packed stream [1, total] in a cache [B, L, ...]: document i is
    sequence i, at its document-relative positions."""
    return documents.ids, documents.positions[0]


@dataclass
class NSALayerCache:
    k: torch.Tensor
    v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    n_cmp: torch.Tensor
    sel_index: torch.Tensor
    sel_weight: torch.Tensor
    selected: torch.Tensor
    reads: torch.Tensor
    geometry: NSAGeometry
    """The layer's NSA geometry: the compressed stream and the overlap band were built with it."""
    fused: FusedWeights

    def rows(self, start: int, stop: int) -> NSALayerCache:
        """The same cache restricted to sequences start..stop-1 (views: writes land in this cache)."""
        r = slice(start, stop)
        return replace(self, k=self.k[:, r], v=self.v[:, r], k_cmp=self.k_cmp[r], v_cmp=self.v_cmp[r],
                       n_cmp=self.n_cmp[r], selected=self.selected[r], reads=self.reads[r])

    def keys(self, branch: str) -> torch.Tensor:
        """Raw keys [B,L,G,Dk] the branch reads."""
        return self.k[BRANCHES.index(branch) % self.k.shape[0]]

    def values(self, branch: str) -> torch.Tensor:
        return self.v[BRANCHES.index(branch) % self.v.shape[0]]

    def fill(self, p: dict[str, torch.Tensor], k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             documents: Documents | None = None) -> None:
        """Store a prefill: project()'s keys/values and the compressor's outputs, of B prompts of one length
        ([B,T,...], [B,Nc,...]) or, with documents, of B packed prompts ([1,total,...], each document's compressed
        tokens back to back in k_cmp [1,C,...])."""
        if documents is None:
            t, nc = p["q"].shape[1], k_cmp.shape[1]
            for s in range(self.k.shape[0]):
                self.k[s, :, :t] = p[f"k_{BRANCHES[s]}"]
                self.v[s, :, :t] = p[f"v_{BRANCHES[s]}"]
            self.k_cmp[:, :nc] = k_cmp
            self.v_cmp[:, :nc] = v_cmp
            self.n_cmp.fill_(nc)
            return
        slots = _slots(documents)
        for s in range(self.k.shape[0]):
            self.k[s].index_put_(slots, p[f"k_{BRANCHES[s]}"][0])
            self.v[s].index_put_(slots, p[f"v_{BRANCHES[s]}"][0])
        offsets = compressed_offsets(documents.cu_seqlens, self.geometry)
        used = int(offsets[-1])  # rows of k_cmp past the last document's tokens hold none
        if used:
            # Document i's compressed tokens are its sequence's first offsets[i+1] - offsets[i].
            compressed = _slots(Documents.from_cu_seqlens(offsets, 1, used))
            self.k_cmp.index_put_(compressed, k_cmp[0, :used])
            self.v_cmp.index_put_(compressed, v_cmp[0, :used])
        self.n_cmp.copy_(offsets[1:] - offsets[:-1])

    def write(self, p: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Store one token per sequence (project()'s outputs [B,1,...]) at positions [B]. (A step on the Triton
        backend stores them from its decode prep kernel instead: nsa.ops.triton.decode_prep.)"""
        # One index_put_ on the base tensor per cache: writing through a view (self.k[s]) makes
        # torch.compile functionalize it as a scatter that copies the whole cache, every step.
        sets = torch.arange(self.k.shape[0], device=positions.device)[:, None]
        where = (sets, _rows(positions)[None], positions[None])  # [S,B] entries
        for cache, name in ((self.k, "k"), (self.v, "v")):
            cache.index_put_(where, torch.stack([p[f"{name}_{BRANCHES[s]}"][:, 0] for s in range(cache.shape[0])]))

    def emit(self, positions: torch.Tensor) -> None:
        """Append the compressed token of the block ending at t where one is due: t+1 >= l, (t+1-l) % d == 0.

        phi runs on every sequence every step and the result is kept only where due: no branch
        on device values, so the step can be captured in a CUDA graph.
        """
        if self.k_cmp.shape[1] == 0:
            return
        block_len, block_stride = self.geometry.block_len, self.geometry.block_stride
        start = (positions + 1 - block_len).clamp_min(0)
        due = (positions + 1 >= block_len) & ((positions + 1 - block_len) % block_stride == 0)
        idx = start[:, None] + torch.arange(block_len, device=positions.device)  # [B,l]
        rows = _rows(positions)
        slot = self.n_cmp.clamp_max(self.k_cmp.shape[1] - 1)
        # The same phi, on the same l RoPE'd tokens, as training; keys and values in one batch.
        blocks = torch.stack([self.keys("cmp")[rows[:, None], idx], self.values("cmp")[rows[:, None], idx]])
        for new, out in zip(compress_pair(self.fused, blocks), (self.k_cmp, self.v_cmp)):
            out[rows, slot] = torch.where(due[:, None, None], new, out[rows, slot])
        self.n_cmp += due.long()


@dataclass
class DenseLayerCache:
    k: torch.Tensor
    v: torch.Tensor
    reads: torch.Tensor
    fused: FusedWeights

    def rows(self, start: int, stop: int) -> DenseLayerCache:
        """The same cache restricted to sequences start..stop-1 (views: writes land in this cache)."""
        r = slice(start, stop)
        return replace(self, k=self.k[r], v=self.v[r], reads=self.reads[r])

    def fill(self, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None) -> None:
        """Store a prefill's keys and values: of B prompts of one length [B,T,G,D], or with documents of B packed
        prompts [1,total,G,D]."""
        if documents is None:
            self.k[:, : k.shape[1]] = k
            self.v[:, : v.shape[1]] = v
            return
        self.k.index_put_(_slots(documents), k[0])
        self.v.index_put_(_slots(documents), v[0])

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        rows = _rows(positions)
        self.k[rows, positions] = k[:, 0]
        self.v[rows, positions] = v[:, 0]


@dataclass
class DecodeCache:
    """Every layer's cache plus `lengths` [B]: tokens held per sequence, i.e. the next token's position."""

    layers: list[NSALayerCache | DenseLayerCache]
    lengths: torch.Tensor
    max_len: int
    host_lengths: list[int] = field(default_factory=list)
    """lengths, tracked on the host: overflow checks need no device sync, and a step can skip phi when no
    sequence completes a compressed block."""

    @property
    def longest(self) -> int:
        return max(self.host_lengths, default=0)

    def emission_due(self) -> bool:
        """Whether the next token of any sequence completes a compressed block (t + 1 >= l, (t + 1 - l) % d == 0)."""
        for geometry in {c.geometry for c in self.layers if isinstance(c, NSALayerCache)}:
            block_len, stride = geometry.block_len, geometry.block_stride
            if any(t + 1 >= block_len and (t + 1 - block_len) % stride == 0 for t in self.host_lengths):
                return True
        return False

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


def selection_band(num_cmp: int, num_sel: int, geometry: NSAGeometry, dtype: torch.dtype,
                   device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weight) [Nc,K]: compressed token i overlaps selection block index[i,k] by weight[i,k]
    (= |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, geometry.overlap_matrix's entries); unused slots
    point at the sentinel column num_sel with weight 0."""
    block_len, block_stride, sel_block = geometry.block_len, geometry.block_stride, geometry.sel_block
    span = -(-block_len // sel_block) + 1  # an interval of l tokens touches at most this many blocks
    start = torch.arange(num_cmp, device=device)[:, None] * block_stride
    j = start // sel_block + torch.arange(span, device=device)
    lo = torch.maximum(start, j * sel_block)
    hi = torch.minimum(start + block_len, (j + 1) * sel_block)
    weight = (hi - lo).clamp_min(0).to(dtype) / block_stride
    index = torch.where((weight > 0) & (j < num_sel), j, num_sel)
    return index, torch.where(index < num_sel, weight, torch.zeros_like(weight))


def _nsa_layer_cache(attn: NSAAttention, batch: int, max_len: int, dtype: torch.dtype, device) -> NSALayerCache:
    geometry = attn.geometry
    g, d = attn.n_kv_heads, attn.head_dim
    num_cmp = geometry.num_compressed_blocks(max_len)
    num_sel = geometry.num_selection_blocks(max_len)
    index, weight = selection_band(num_cmp, num_sel, geometry, torch.promote_types(dtype, torch.float32), device)
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    return NSALayerCache(
        k=zeros(attn.n_kv_sets, batch, max_len, g, d), v=zeros(attn.n_kv_sets, batch, max_len, g, d),
        k_cmp=zeros(batch, num_cmp, g, d), v_cmp=zeros(batch, num_cmp, g, d),
        n_cmp=torch.zeros(batch, dtype=torch.long, device=device), sel_index=index, sel_weight=weight,
        selected=torch.full((batch, g, geometry.n_sel), -1, dtype=torch.long, device=device),
        reads=torch.zeros(batch, g, dtype=torch.long, device=device), geometry=geometry,
        fused=fuse(attn.input_layers, (attn.compress_k, attn.compress_v), attn.gate),
    )


def new_cache(model: nn.Module, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> DecodeCache:
    """Zeroed caches for `batch_size` sequences of up to `max_len` tokens, in the model's dtype and device.

    Each layer's cache holds a snapshot of its weights for fused matmuls: build it after loading weights.
    """
    if max_len < 1 or batch_size < 1:
        raise ValueError(f"max_len and batch_size must be >= 1, got {max_len} and {batch_size}")
    param = next(model.parameters())
    dtype, device = dtype or param.dtype, device or param.device
    layers = []
    for block in model.layers:
        attn = block.attn
        if isinstance(attn, NSAAttention):
            layers.append(_nsa_layer_cache(attn, batch_size, max_len, dtype, device))
        else:
            shape = (batch_size, max_len, attn.n_kv_heads, attn.head_dim)
            layers.append(DenseLayerCache(
                k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
                reads=torch.zeros(batch_size, attn.n_kv_heads, dtype=torch.long, device=device),
                fused=fuse((attn.wq, attn.wkv)),
            ))
    return DecodeCache(layers, torch.zeros(batch_size, dtype=torch.long, device=device), max_len,
                       host_lengths=[0] * batch_size)
