"""Training configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and output of one training run."""

    steps: int = 500
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (tokens per step = batch_size * grad_accum * seq_len)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 40
    """Steps of linear warmup from 0 to lr before the cosine decay."""
    weight_decay: float = 0.01
    """AdamW weight decay, applied to matrices and embeddings only (not norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW beta1, beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 100
    """Run validation every this many steps (and at the end); 0 disables."""
    eval_batches: int = 8
    """Micro-batches of held-out windows per validation."""
    log_every: int = 10
    """Write a metrics row every this many steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps; 0 saves only at the end."""
    seed: int = 1337
    """Seed for initialisation and data order."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' is bf16 autocast on GPU and fp32 on CPU."""
    out_dir: str = "runs"
    """Folder that receives one sub-folder per run."""
    run_name: str = ""
    """Name of this run's folder; empty uses the attention kind and a timestamp."""
    sample_tokens: int = 200
    """Tokens to generate at the end of training as a sample; 0 skips it."""
    sample_prompt: str = "And God said"
    """Prompt of the end-of-run sample."""
    progress: bool = True
    """Show a progress bar (otherwise one line per log step)."""
