"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """Matrices and embeddings decay; norm scales and other vectors do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                          cfg: TrainConfig) -> None:
    """After loading a checkpoint: the learning rate, schedule, betas and weight decay of `cfg` from the
    scheduler's current step on (a loaded optimizer carries the values it was saved with). Group 0 is the
    decaying group (build_optimizer)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    factor = lr_factor(scheduler.last_epoch, cfg)
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = cfg.lr * factor
        group["betas"] = tuple(cfg.betas)
        group["weight_decay"] = cfg.weight_decay if i == 0 else 0.0
