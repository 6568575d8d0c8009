"""Attention layers: NSAAttention (three gated branches) and DenseAttention (the SDPA baseline)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from ..errors import ConfigError
from ..ops import nsa_attention, select_blocks
from ..ops.api import resolve_backend
from .compression import BlockCompressor, compress_pair
from .config import ModelConfig
from .documents import Documents
from .rope import apply_rope
from .selection_distill import packed_selection_distillation, selection_distillation, with_auxiliary_loss

BRANCHES = ("cmp", "sel", "win")


def gates_from_logits(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Gates [..., 3] from the gate MLP's logits [..., 3] (cmp, sel, win): each branch's sigmoid, or a softmax over
    the branches (shares summing to 1, so the layer's attention cannot be switched off)."""
    return torch.sigmoid(logits) if kind == "sigmoid" else torch.softmax(logits, dim=-1)


class GatePull(torch.autograd.Function):
    """Identity on softmax gate logits z [..., n_heads, 3] whose backward adds pulls that steer training without
    entering the reported loss, each the gradient of a term (averaged over rows (token, head) for the spread):

    - spread: spread * sum_c (z_c - mean_c z)^2 per row, toward equal logits;
    - floor: -log m_hc, averaged over heads h, for every branch c whose share averaged over the tokens,
      m_hc = mean_t p_thc with p = softmax(z), is below `floor`. A head that gives a branch little weight at some
      tokens and more at others gets nothing; only a branch the head has switched off almost everywhere (a
      collapse) is pulled back, until its mean share reaches the floor.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, spread: float, floor: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.spread, ctx.floor = spread, floor
        return logits.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        pull = torch.zeros_like(logits)
        if ctx.spread:
            pull += 2.0 * ctx.spread * (logits - logits.mean(-1, keepdim=True))
        if ctx.floor:
            pull += mean_share_floor_pull(logits, ctx.floor)
        rows = logits.numel() // logits.shape[-1]
        return grad + pull / rows, None, None


def mean_share_floor_pull(logits: torch.Tensor, floor: float) -> torch.Tensor:
    """rows * d/dz of (1/n_heads) sum_{h,c: m_hc < floor} -log m_hc, for logits z [..., n_heads, 3] with
    rows = z.numel() / 3 and m_hc the share p = softmax(z) of branch c at head h averaged over the tokens (every
    leading dimension): with a = p * below / m, the gradient at a row is (p_j * sum_c a_c - a_j) / rows.
    """
    shares = torch.softmax(logits, dim=-1)
    means = shares.mean(dim=tuple(range(logits.dim() - 2)))  # [n_heads, 3]
    weight = (means < floor).to(shares.dtype) / means.clamp_min(torch.finfo(shares.dtype).tiny)
    pulled = shares * weight
    return shares * pulled.sum(-1, keepdim=True) - pulled


class GateMLP(nn.Module):
    """g[t, h, c] = sigmoid(MLP(x_t)) (or a softmax over c): one gate per head and branch, in (cmp, sel, win) order.

    hidden=0 makes the MLP a single linear map (as in fla-core's NSA layer).
    """

    def __init__(self, dim: int, hidden: int, n_heads: int, kind: str = "sigmoid", spread_penalty: float = 0.0,
                 floor: float = 0.0):
        super().__init__()
        self.n_heads, self.kind, self.spread_penalty, self.floor = n_heads, kind, spread_penalty, floor
        self.fc1 = nn.Linear(dim, hidden, bias=False) if hidden else None
        self.fc2 = nn.Linear(hidden or dim, n_heads * len(BRANCHES), bias=False)

    @property
    def first_layer(self) -> nn.Linear:
        """The linear map applied to x first (fc1, or fc2 for a linear gate): decoding fuses it with the layer's."""
        return self.fc1 if self.fc1 is not None else self.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.first_layer(x))

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """Gates [..., n_heads, 3] from h = first_layer(x)."""
        logits = self.fc2(F.silu(h)) if self.fc1 is not None else h
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).view(*h.shape[:-1], self.n_heads,
                                                                                  len(BRANCHES))
        if (self.spread_penalty or self.floor) and logits.requires_grad:
            logits = GatePull.apply(logits, self.spread_penalty, self.floor)
        return gates_from_logits(logits, self.kind)


class NSAAttention(nn.Module):
    """Native Sparse Attention layer.

    One RoPE'd query projection; keys/values per branch (separate by default, or one
    shared projection); keys of every branch are RoPE'd at their token positions, the
    compressed keys before phi pools them; per-head sigmoid gates; output projection.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        nsa = cfg.nsa
        self.cfg = cfg
        self.geometry = nsa.geometry
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_kv_sets = 1 if nsa.shared_kv else len(BRANCHES)
        kv_width = self.n_kv_sets * 2 * cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.compress_k = BlockCompressor(cfg.head_dim, nsa.block_len, nsa.block_stride, nsa.phi, nsa.phi_hidden,
                                         nsa.backend)
        self.compress_v = BlockCompressor(cfg.head_dim, nsa.block_len, nsa.block_stride, nsa.phi, nsa.phi_hidden,
                                         nsa.backend)
        self.gate = GateMLP(cfg.dim, nsa.gate_hidden, cfg.n_heads, nsa.gate, nsa.gate_spread_penalty,
                            nsa.gate_floor)

    @property
    def input_layers(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The linear maps of the layer input (queries, keys/values, the gate's first layer), in project_from's order."""
        return self.wq, self.wkv, self.gate.first_layer

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, torch.Tensor]:
        """Queries, per-branch keys/values (raw, RoPE'd where keys) and gates for x [B,T,dim]."""
        return self.project_from(*(layer(x) for layer in self.input_layers), cos, sin)

    def project_from(self, q_lin: torch.Tensor, kv_lin: torch.Tensor, gate_lin: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, gates: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """project() given the outputs of input_layers (which a decode step computes as one matmul); `gates`, if
        given, stands for self.gate.finish(gate_lin) (a decode step computes it its own way)."""
        b, t, _ = q_lin.shape
        q = apply_rope(q_lin.view(b, t, self.n_heads, self.head_dim), cos, sin)
        kv = kv_lin.view(b, t, self.n_kv_sets, 2, self.n_kv_heads, self.head_dim)
        keys = apply_rope(kv[:, :, :, 0].flatten(2, 3), cos, sin).view(b, t, self.n_kv_sets, self.n_kv_heads, -1)
        values = kv[:, :, :, 1]
        out = {"q": q, "gates": self.gate.finish(gate_lin) if gates is None else gates}
        for i, branch in enumerate(BRANCHES):
            kv_set = i % self.n_kv_sets  # with shared_kv every branch reads set 0
            out[f"k_{branch}"] = keys[:, :, kv_set]
            out[f"v_{branch}"] = values[:, :, kv_set]
        return out

    def selected_blocks(self, p: dict[str, torch.Tensor], documents: Documents | None = None) -> torch.Tensor:
        """Block indices [B,T,G,n] the selected branch attends to, for project()'s outputs p (statistics, eval);
        with documents, [1, B*T, G, n] document-relative ones."""
        p, cu_seqlens = _packed(p, documents)
        return select_blocks(p["q"], self.compress_k(p["k_cmp"], cu_seqlens), geometry=self.geometry,
                             backend=self.cfg.nsa.backend, cu_seqlens=cu_seqlens)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B,T,dim] -> [B,T,dim]. With documents (packed sequences), cos/sin are at document-relative positions
        and every document is its own sequence: the batch runs as one packed stream of B*T tokens."""
        if documents is not None and resolve_backend(self.cfg.nsa.backend, x.device, x.shape[1]) == "reference":
            return _attend_untraced(self, x, cos, sin, documents)
        return self._attend(x, cos, sin, documents)

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None) -> torch.Tensor:
        b, t, _ = x.shape
        p, cu_seqlens = _packed(self.project(x, cos, sin), documents)
        k_cmp, v_cmp = compress_pair(self.compress_k, self.compress_v, p["k_cmp"], p["v_cmp"], cu_seqlens)
        o = nsa_attention(p["q"], k_cmp, v_cmp, p["k_sel"], p["v_sel"], p["k_win"], p["v_win"],
                          p["gates"].to(p["q"].dtype), geometry=self.geometry, backend=self.cfg.nsa.backend,
                          cu_seqlens=cu_seqlens)
        nsa = self.cfg.nsa
        if nsa.selection_distill and self.training and torch.is_grad_enabled():
            args = (p["q"], k_cmp, p["k_sel"], self.geometry, nsa.selection_distill_queries)
            kl = (selection_distillation(*args) if cu_seqlens is None
                  else packed_selection_distillation(*args, cu_seqlens))
            o = with_auxiliary_loss(o, nsa.selection_distill * kl)
        return self.wo(o.reshape(b, t, self.n_heads * self.head_dim))


# The PyTorch code's packed documents loop over the boundaries as Python ints: under torch.compile they would be
# specialised to each batch's boundaries (a recompile a batch, up to Dynamo's limit) and break the graph between
# views, which AOTAutograd failed to rebuild on the CPU. The kernels' packed op is opaque to the compiler instead.
_attend_untraced = torch.compiler.disable(NSAAttention._attend)


def _packed(p: dict[str, torch.Tensor], documents: Documents | None) -> tuple[dict[str, torch.Tensor],
                                                                                torch.Tensor | None]:
    """project()'s outputs as one packed stream [1, B*T, ...] and its boundaries; unchanged without documents."""
    if documents is None:
        return p, None
    return {name: value.flatten(0, 1).unsqueeze(0) for name, value in p.items()}, documents.cu_seqlens


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""model.dense_backend -> the SDPA kernel it pins ('auto' pins none)."""


class DenseAttention(nn.Module):
    """Causal grouped-query attention: the baseline NSA is measured against. Through PyTorch SDPA (the kernel
    model.dense_backend names), or, for packed documents, attending within each document only (document_attention).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.backend = cfg.dense_backend
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k, v = self.wkv(x).view(b, t, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k = apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if documents is None:
            o = dense_sdpa(q, k, v, self.backend)
        else:
            o = document_attention(q, k, v, documents)
        return self.wo(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


# Packed documents are attended per row, [B, heads, T, D] as for SDPA, with a mask over [B, T, T]: rows never
# share a document, so the flattened batch's [B*T, B*T] mask would only add B - 1 empty blocks per query block
# (B times the mask to build) for the same result. B and T are the batch's, fixed for a run, so the mask's shape
# is static under torch.compile and CUDA graphs; only its content (the document ids) changes per batch.

FLEX_MIN_HEAD_DIM = 16
"""The smallest query/key and value head dim that FlexAttention's GPU kernel takes."""


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """Causal grouped-query attention of [B, heads, T, D] tensors within documents: the query at t of row b sees
    the keys s <= t of its own document (nsa.model.documents).

    On a GPU through FlexAttention with the documents' block mask (Documents.with_block_mask: built once per
    forward outside the compiled blocks, or here for an eager caller); elsewhere through SDPA with the mask in
    full (FlexAttention has no backward on the CPU, and its CPU forward outside torch.compile materialises every
    score anyway). Head dims under FLEX_MIN_HEAD_DIM, which FlexAttention's GPU kernel refuses, take SDPA too.
    """
    b, _, t, _ = q.shape
    if q.device.type != "cuda" or min(q.shape[-1], v.shape[-1]) < FLEX_MIN_HEAD_DIM:
        return masked_document_sdpa(q, k, v, documents.ids.view(b, t))
    block_mask = documents.block_mask if documents.block_mask is not None else documents.with_block_mask().block_mask
    if torch.compiler.is_compiling():  # inside a compiled block: compiled with it
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=True)


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled on its own (for eager callers; eager FlexAttention would materialise every score),
    made on first use: importing torch.compile's machinery takes seconds."""
    return torch.compile(flex_attention, dynamic=False)


def masked_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """document_attention through SDPA with the [B, 1, T, T] mask written out."""
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Causal grouped-query SDPA of [B, heads, T, D] tensors with the kernel model.dense_backend names."""
    if backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    try:
        with sdpa_kernel([SDPA_BACKENDS[backend]]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except RuntimeError as e:
        # CUDA's words, then the CPU's, for a pinned kernel that refuses the call.
        if "No available kernel" not in str(e) and "No viable backend" not in str(e):
            raise
        raise ConfigError(
            f"model.dense_backend={backend} has no SDPA kernel for this call ({q.device.type}, {q.dtype}, "
            f"head dim {q.shape[-1]}); use model.dense_backend=auto"
        ) from None


def check_dense_backend(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ConfigError before anything compiles if model.dense_backend has no kernel for this model's attention
    on `device` in `dtype` (inside a compiled step the refusal would surface as a compiler traceback)."""
    if cfg.attention != "dense" or cfg.dense_backend == "auto":
        return
    q = torch.zeros(1, cfg.n_heads, 16, cfg.head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, cfg.n_kv_heads, 16, cfg.head_dim, device=device, dtype=dtype)
    dense_sdpa(q, kv, kv, cfg.dense_backend)
