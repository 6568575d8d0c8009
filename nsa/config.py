"""The whole run configuration: model, data and training sections, from YAML plus overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

from .data.config import DataConfig
from .errors import ConfigError
from .model.config import ModelConfig
from .train.config import TrainConfig
from .typed_config import apply_overrides, from_dict, load_yaml


@dataclass
class RunConfig:
    """Everything `nsa train` needs; the defaults train the tiny model on the embedded corpus."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The network (see configs/m7c.yaml for M7C)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The text and its tokenizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, logging and outputs."""

    def validate(self) -> None:
        self.model.validate()
        t = self.train
        for key in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "log_every"):
            if getattr(t, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
        for key in ("warmup_steps", "eval_every", "checkpoint_every", "sample_tokens"):
            if getattr(t, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if not 0 <= self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.data.val_fraction}")


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if any), then `key=value` overrides; validated."""
    cfg = from_dict(RunConfig, load_yaml(path) if path else {})
    cfg = apply_overrides(cfg, overrides or [])
    cfg.validate()
    return cfg
