"""The decoder-only language model: embeddings, pre-norm blocks, tied output head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DenseAttention, NSAAttention
from .compression import BlockCompressor
from .config import ModelConfig
from .documents import Documents
from .rope import RotaryEmbedding


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of the output head's logits against targets (-1 ignored), in float32.

    A module of its own, with no parameters, so that the trainer can compile it like a block: compiled, the
    float32 logits [tokens, vocabulary] are never written out, which eager execution must do in full.
    """

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = NSAAttention(cfg) if cfg.attention == "nsa" else DenseAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_hidden)
        self.attention_drop = cfg.attention_drop

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), cos, sin, documents=documents)
        if self.training and self.attention_drop > 0:
            attended = attended * sequence_keep_mask(x, self.attention_drop)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


def sequence_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """[B,1,1] in x's dtype for x [B,T,D]: 0 for a sequence dropped (probability p), 1/(1 - p) for one kept, so
    that the expected output is the undropped one (stochastic depth). Drawn from the default generator on x's
    device, whose state checkpoints keep: a resumed run draws the masks it would have drawn."""
    keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= p
    return keep.to(x.dtype) / (1 - p)


class Transformer(nn.Module):
    """LLaMA-style decoder with NSA or dense attention (docs/design.md#model-presets)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.loss = NextTokenLoss()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) weights; residual outputs scaled by 1/sqrt(2 * n_layers); phi starts at mean."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attn.wo.weight, std=residual_std)
            nn.init.normal_(layer.mlp.w_down.weight, std=residual_std)
        for module in self.modules():
            if isinstance(module, BlockCompressor):
                module.reset_parameters()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed hidden states [B,T,dim] for tokens [B,T]; `lm_head` of them gives the logits.

        With cu_seqlens (int32 document boundaries over the B*T tokens, docs/design.md#packed-documents), each
        document is its own sequence: positions restart at 0 and no token attends across a boundary.
        Evaluation reads logits at a few positions only: at 64k tokens and the GPT-2 vocabulary the full
        logits would take gigabytes.
        """
        b, t = tokens.shape
        documents = None if cu_seqlens is None else Documents.from_cu_seqlens(cu_seqlens, b, t)
        if documents is not None and self.cfg.attention == "dense" and tokens.is_cuda:
            documents = documents.with_block_mask()  # once for every layer, before the compiled blocks
        # cos/sin [T,1,D/2] of positions 0..T-1, or [B,T,1,D/2] of each token's position in its document.
        positions = torch.arange(t, device=tokens.device) if documents is None else documents.positions
        cos, sin = self.rope(positions)
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, documents)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B,T,V] for tokens [B,T]; with targets, the mean cross-entropy (targets -1 ignored); with
        cu_seqlens, over packed documents (see hidden)."""
        h = self.hidden(tokens, cu_seqlens)
        if targets is None:
            return self.lm_head(h)
        # The weight goes in as an argument: under FSDP2 it is the gathered parameter only during forward.
        return self.loss(h, self.lm_head.weight, targets)
