"""Model configuration and the named presets (`tiny`, `m7c`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..ops.geometry import FIELDS, NSAGeometry


@dataclass
class NSAParams:
    """Native Sparse Attention hyper-parameters (docs/design.md#hyper-parameters) and the layer's other choices."""

    block_len: int = 32
    """Compression block length l: raw tokens summarised by one compressed token."""
    block_stride: int = 16
    """Compression stride d between compressed blocks; must divide block_len and sel_block."""
    sel_block: int = 64
    """Selection block length l': the unit the selected branch attends to."""
    n_sel: int = 16
    """Selected blocks per query n, including the forced ones (block 0, current, previous); >= 3."""
    window: int = 512
    """Sliding-window length w of the window branch."""
    phi: Literal["mlp", "mean"] = "mlp"
    """Compression function: 'mean' pools a block; 'mlp' adds a zero-initialised MLP of the block to that mean."""
    phi_hidden: int = 128
    """Hidden width of the compression MLP (phi='mlp')."""
    gate_hidden: int = 64
    """Hidden width of the gate MLP that produces one gate per head and branch; 0 makes it one linear layer."""
    gate: Literal["sigmoid", "softmax"] = "sigmoid"
    """How the gate MLP's three logits per head become gates: 'sigmoid' (the paper's), each in (0, 1) on its own, so a layer can switch its attention off; 'softmax' over the three branches, shares that sum to 1."""
    gate_spread_penalty: float = 0.0
    """Training only, softmax gates: adds the gradient of this times the mean over (token, head) of the three logits'
    squared distance from their mean (not the reported loss). A softmax share near zero gets almost no gradient, so a
    branch whose gate collapses does not come back; this pulls it back, but it also pulls healthy gates toward
    uniform, and on the retrieval recipe it cost the task in some seeds (docs/evaluation.md). 0: off."""
    gate_floor: float = 0.0
    """Training only, softmax gates: wherever a head's share of a branch, averaged over the tokens of the batch, is
    below this (the branch is switched off almost everywhere: a collapse), the backward adds the gradient of
    -log(that mean share), averaged over heads (not the reported loss), which pulls the branch back up to the floor.
    A head that gives a branch little weight at some tokens and more at others gets nothing, so gates that do not
    collapse train exactly as without it. Below 1/3; 0: off. Not yet run over the retrieval grid
    (docs/evaluation.md)."""
    selection_distill: float = 0.0
    """Training only: weight of a KL term that teaches the compressed scores, which pick the selected blocks, where
    the selected branch's own queries and keys attend over the whole context (nsa.model.selection_distill), at the
    last model.nsa.selection_distill_queries queries of each sequence; added to the gradient, not to the reported
    loss. Top-n has no gradient, so without it the scores learn only through the compressed branch's output,
    scaled by its gate. 0: off (the paper's NSA). With packed documents it is computed at the end of each document,
    outside torch.compile (it reads the documents' lengths on the host)."""
    selection_distill_queries: int = 64
    """How many queries at the end of each sequence (document) model.nsa.selection_distill is computed at (its cost is that of
    this many rows of dense attention): the retrieval tasks ask their question there."""
    shared_kv: bool = False
    """Share one key/value projection across the three branches (the paper uses separate ones)."""
    backend: Literal["auto", "reference", "triton"] = "auto"
    """Attention implementation: 'auto' is the Triton kernels on CUDA and the reference elsewhere; 'reference' forces the pure-PyTorch oracle (for debugging); 'triton' forces the kernels."""

    @property
    def geometry(self) -> NSAGeometry:
        """The block geometry of these values (ValueError naming a broken rule; ModelConfig.validate says it with
        the config keys)."""
        return NSAGeometry(self.block_len, self.block_stride, self.sel_block, self.n_sel, self.window)


@dataclass
class ModelConfig:
    """A LLaMA-style decoder: pre-norm RMSNorm, SwiGLU MLP, RoPE, no biases, tied embeddings."""

    attention: Literal["nsa", "dense"] = "nsa"
    """'nsa' for Native Sparse Attention; 'dense' for causal SDPA, the baseline."""
    dense_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the dense model's attention in training: 'auto' lets PyTorch choose for the GPU; 'flash' is
    FlashAttention-2, the dense reference of docs/performance.md. A kernel that cannot run the model's attention
    stops the run with an error naming this key. A checkpoint loaded for generation or evaluation goes back to
    'auto' (the kernel is the training machine's, not the model's). Batches of packed documents
    (data.document_masking) are attended through FlexAttention on a GPU (SDPA with the mask written out
    elsewhere), whatever this says."""
    vocab_size: int = 0
    """Embedding rows; 0 takes the tokenizer's vocabulary padded up to a multiple of 64."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per layer."""
    n_kv_heads: int = 2
    """Key/value heads (GQA groups); must divide n_heads."""
    head_dim: int = 32
    """Width of each attention head (queries, keys and values)."""
    mlp_hidden: int = 384
    """Hidden width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """RoPE base frequency. A larger base turns the slow dimensions less over long distances (the retrieval recipe
    uses 1e6 to carry retrieval from 8k of training to 64k)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    attention_drop: float = 0.0
    """Stochastic depth on every block's attention (0 = off): in training, each sequence of a batch skips a block's
    attention with this probability and the kept outputs are scaled by 1/(1 - p); evaluation and generation keep
    every layer. A task then cannot rest on a single layer's attention."""
    init_from: str = ""
    """Weights a new run starts from instead of the random initialisation ('' = none): a checkpoint folder (or a
    run folder: its latest checkpoint), e.g. the output of `nsa convert`, or a Hugging Face folder written by
    `nsa export --format hf`. Every tensor's shape must match this config's. A resumed run takes its weights
    from the checkpoint it resumes."""
    nsa: NSAParams = field(default_factory=lambda: NSAParams(
        block_len=16, block_stride=8, sel_block=32, n_sel=4, window=64, phi_hidden=64, gate_hidden=32
    ))
    """NSA hyper-parameters (used when attention='nsa')."""

    def validate(self) -> None:
        """Raise ConfigError naming the offending key and a fix."""
        if self.n_heads < 1 or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            options = [g for g in range(1, self.n_heads + 1) if self.n_heads % g == 0] if self.n_heads > 0 else [1]
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads}); "
                f"choose n_kv_heads among {', '.join(map(str, options))}"
            )
        for key in ("dim", "n_layers", "head_dim", "mlp_hidden"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim ({self.head_dim}) must be even for RoPE")
        for key in ("rope_theta", "norm_eps", "init_std"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key} must be > 0, got {getattr(self, key)}")
        if not 0 <= self.attention_drop < 1:
            raise ConfigError(f"model.attention_drop is a probability in [0, 1), got {self.attention_drop}; 0 turns "
                              "it off")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be >= 0 (0 = from the tokenizer), got {self.vocab_size}")
        if self.attention == "nsa":
            _validate_nsa(self.nsa)


def _validate_nsa(c: NSAParams) -> None:
    try:
        c.geometry
    except ValueError as e:  # the geometry's own rules, its field names said as config keys
        raise ConfigError(re.sub(rf"\b({'|'.join(FIELDS)})\b", r"model.nsa.\1", str(e))) from None
    if c.phi_hidden < 1:
        raise ConfigError(f"model.nsa.phi_hidden must be >= 1, got {c.phi_hidden}")
    if c.gate_hidden < 0:
        raise ConfigError(f"model.nsa.gate_hidden must be >= 0 (0: a linear gate), got {c.gate_hidden}")
    if c.gate_spread_penalty < 0:
        raise ConfigError(f"model.nsa.gate_spread_penalty must be >= 0 (0: off), got {c.gate_spread_penalty}")
    if c.gate_spread_penalty and c.gate != "softmax":
        raise ConfigError("model.nsa.gate_spread_penalty needs softmax gates (sigmoid gates are not shares of one "
                          "another); set model.nsa.gate=softmax or the penalty to 0")
    if c.selection_distill < 0:
        raise ConfigError(f"model.nsa.selection_distill must be >= 0 (0: off), got {c.selection_distill}")
    if c.selection_distill_queries < 1:
        raise ConfigError(f"model.nsa.selection_distill_queries must be >= 1, got {c.selection_distill_queries}")
    if not 0 <= c.gate_floor < 1 / 3:
        raise ConfigError(f"model.nsa.gate_floor must be in [0, 1/3) (three shares sum to 1; 0: off), "
                          f"got {c.gate_floor}")
    if c.gate_floor and c.gate != "softmax":
        raise ConfigError("model.nsa.gate_floor needs softmax gates (a floor on shares of one another); set "
                          "model.nsa.gate=softmax or the floor to 0")


def tiny() -> ModelConfig:
    """The default model (docs/design.md#tiny): a small NSA model that trains on a CPU in minutes."""
    return ModelConfig()


def m7c() -> ModelConfig:
    """M7C, the reference model (docs/design.md#m7c): a 125M-parameter LLaMA-style decoder with NSA in every
    layer. Width 768, 12 layers, 12 query heads over 2 key/value heads of dim 64, SwiGLU hidden 2048; NSA with
    l = 32, d = 16, l' = 64, n = 16, w = 512; the GPT-2 vocabulary (50,257 tokens) padded to 50,304 rows.
    configs/m7c.yaml trains it at sequence length 2048."""
    return ModelConfig(
        vocab_size=50304,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=2,
        head_dim=64,
        mlp_hidden=2048,
        nsa=NSAParams(),
    )


PRESETS = {"tiny": tiny, "m7c": m7c}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}'; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name]())
