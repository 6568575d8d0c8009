"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules (warmup, then cosine,
linear or warmup-stable-decay)."""

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
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then cfg.schedule down to
    min_lr_ratio at cfg.steps. A pure function of the step, so a resumed run continues its schedule exactly."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = wsd_decay_start(cfg)
        if step < start:
            return 1.0
        return _toward_floor(1 - math.sqrt(_progress(step, start, cfg.steps)), cfg)
    progress = _progress(step, cfg.warmup_steps, cfg.steps)
    if cfg.schedule == "linear":
        return _toward_floor(1 - progress, cfg)
    return _toward_floor(0.5 * (1 + math.cos(math.pi * progress)), cfg)


def wsd_decay_start(cfg: TrainConfig) -> int:
    """The first step of the 'wsd' decay: the last decay_fraction of the steps, and never inside the warmup."""
    return max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))


def _progress(step: int, start: int, end: int) -> float:
    """How far `step` is from `start` to `end`, in [0, 1]."""
    return min(1.0, (step - start) / max(1, end - start))


def _toward_floor(share: float, cfg: TrainConfig) -> float:
    """The factor `share` of the way from min_lr_ratio (0) up to 1 (1)."""
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * share


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
