"""phi: the learnable map from a block of l keys (or values) to one compressed token."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.geometry import num_compressed_blocks, packed_block_starts
from ..ops.packing import compression_layout


class BlockCompressor(nn.Module):
    """Compress x [B,T,G,D] into [B,Nc,G,D], block i covering tokens [i*d, i*d + l).

    kind='mean' averages each block. kind='mlp' adds to that mean an MLP of the
    flattened block plus a learnable intra-block position embedding; the MLP's last
    layer starts at zero so training begins from mean pooling. `backend` follows the
    NSA op's: under 'auto' the MLP runs as Triton kernels on CUDA (ops/triton/compression.py).
    """

    def __init__(self, head_dim: int, block_len: int, block_stride: int, kind: str = "mlp", hidden: int = 128,
                 backend: str = "auto"):
        super().__init__()
        self.block_len = block_len
        self.block_stride = block_stride
        self.kind = kind
        self.backend = backend
        if kind == "mlp":
            self.pos = nn.Parameter(torch.empty(block_len, head_dim))
            self.fc1 = nn.Linear(block_len * head_dim, hidden, bias=False)
            self.fc2 = nn.Linear(hidden, head_dim, bias=False)
            self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        if self.kind == "mlp":
            nn.init.normal_(self.pos, std=std)
            nn.init.normal_(self.fc1.weight, std=std)
            nn.init.zeros_(self.fc2.weight)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """[B,Nc,G,D]; with cu_seqlens (packed documents, x [1,total,G,D]), [1, Nc(total), G, D] holding each
        document's compressed tokens back to back in document order and zeros after them
        (docs/design.md#packed-documents)."""
        b, t, g, d = x.shape
        if t < self.block_len:
            return x.new_zeros(b, 0, g, d)
        if self._on_triton(x):
            return _phi_kernels((self,), (x,), cu_seqlens)[0]
        if cu_seqlens is not None:
            return self._packed(x, cu_seqlens)
        return self._pool(x.unfold(1, self.block_len, self.block_stride).transpose(-1, -2))

    def _pool(self, blocks: torch.Tensor) -> torch.Tensor:
        """phi of blocks [B,Nc,G,l,D] -> [B,Nc,G,D]."""
        mean = blocks.mean(dim=-2)
        if self.kind == "mean":
            return mean
        return mean + self.fc2(nn.functional.silu(self.fc1((blocks + self.pos).flatten(-2))))

    def _packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Blocks gathered inside each document (no Python loop over documents), then pooled."""
        total = x.shape[1]
        rows = num_compressed_blocks(total, self.block_len, self.block_stride)  # enough for any packing
        starts, valid = packed_block_starts(cu_seqlens, self.block_len, self.block_stride, rows)
        tokens = (starts[:, None] + torch.arange(self.block_len, device=x.device)).clamp(max=total - 1)
        blocks = x[0, tokens].permute(0, 2, 1, 3).unsqueeze(0)  # [1, rows, G, l, D]
        return torch.where(valid[None, :, None, None], self._pool(blocks), 0.0)

    @property
    def signature(self) -> tuple:
        """What two compressors must share to run as one launch: kind, geometry, weight shapes and type."""
        weights = tuple((w.shape, w.dtype) for w in self.mlp_weights) if self.kind == "mlp" else ()
        return self.kind, self.block_len, self.block_stride, weights

    @property
    def mlp_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pos, fc1's weight, fc2's weight) of kind 'mlp'."""
        return self.pos, self.fc1.weight, self.fc2.weight

    def _on_triton(self, x: torch.Tensor) -> bool:
        """Whether the MLP runs as the Triton kernels for x (T >= block_len)."""
        from ..ops.api import resolve_backend

        # The kernel module imports triton: reach it only once the backend says Triton runs here.
        if self.kind != "mlp" or resolve_backend(self.backend, x.device, x.shape[1]) != "triton":
            return False
        from ..ops.triton.compression import phi_mlp_supports

        return phi_mlp_supports(self.block_len, self.block_stride)


def compress_pair(first: BlockCompressor, second: BlockCompressor, x: torch.Tensor, y: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(y)); where both run as the Triton kernels on inputs of one shape, type and geometry (the
    keys and values of M7C), as one launch per kernel, packed documents or not."""
    same = (x.shape == y.shape and x.dtype == y.dtype and x.shape[1] >= first.block_len
            and first.signature == second.signature)
    if same and first._on_triton(x) and second._on_triton(y):
        return _phi_kernels((first, second), (x, y), cu_seqlens)
    return first(x, cu_seqlens), second(y, cu_seqlens)


def _phi_kernels(compressors: tuple[BlockCompressor, ...], xs: tuple[torch.Tensor, ...],
                 cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The MLP phi of one or two compressors of one geometry on the Triton kernels (T >= block_len)."""
    from ..ops.triton.compression import phi_mlp_triton

    block_len, block_stride = compressors[0].block_len, compressors[0].block_stride
    layout = None
    if cu_seqlens is not None:
        layout = compression_layout(cu_seqlens, block_len, block_stride, xs[0].shape[1])
    return phi_mlp_triton(xs, tuple(c.mlp_weights for c in compressors), block_len, block_stride, layout)
