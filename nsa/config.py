"""The whole run configuration: model, data and training sections, from YAML plus overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .data.config import DataConfig
from .errors import ConfigError
from .model.config import ModelConfig
from .telemetry.config import TelemetryConfig
from .train.config import CheckpointConfig, ParallelConfig, TrainConfig
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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Single process, DDP or FSDP2, activation checkpointing, compilation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention and resume."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Run artifacts (heartbeats, TensorBoard), NSA health statistics and the stall watchdog."""

    def validate(self) -> None:
        self.model.validate()
        t = self.train
        for key in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "log_every"):
            if getattr(t, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
        for key in ("warmup_steps", "eval_every", "sample_tokens"):
            if getattr(t, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
        if self.checkpoint.every < 0 or self.checkpoint.keep < 0:
            raise ConfigError("checkpoint.every and checkpoint.keep must be >= 0")
        tel = self.telemetry
        if tel.stall_timeout_s < 0 or tel.health_every < 0 or tel.health_tokens < 1:
            raise ConfigError("telemetry.stall_timeout_s and telemetry.health_every must be >= 0, "
                              "telemetry.health_tokens >= 1")
        # Before the launch checks, so a config mistake is named first on any machine.
        self.parallel.check_cudagraphs(self.parallel.mode)
        if self.parallel.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be > 0, got {self.parallel.timeout_s}")
        if self.data.source in ("text", "jsonl", "parquet", "shards") and not self.data.path:
            raise ConfigError(f"data.source={self.data.source} needs data.path=...")
        if self.data.source == "hf" and not self.data.hf_name:
            raise ConfigError("data.source=hf needs data.hf_name=... (e.g. HuggingFaceFW/fineweb-edu)")
        self._validate_optimizer()
        if not 0 <= tel.gate_collapse < 0.5:
            raise ConfigError(f"telemetry.gate_collapse must be in [0, 0.5), got {tel.gate_collapse}")
        if self.data.first_batch_timeout_s <= 0:
            raise ConfigError(f"data.first_batch_timeout_s must be > 0, got {self.data.first_batch_timeout_s}")
        if self.data.retrieval.kv_pairs < 1:
            raise ConfigError(f"data.retrieval.kv_pairs must be >= 1, got {self.data.retrieval.kv_pairs}")
        if not 0 <= self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.data.val_fraction}")

    def _validate_optimizer(self) -> None:
        t = self.train
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if not 0 < t.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction must be in (0, 1], got {t.decay_fraction}")
        if t.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {t.weight_decay}")
        if t.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}")
        if not all(0 <= b < 1 for b in t.betas):
            raise ConfigError(f"train.betas must both be in [0, 1), got {list(t.betas)} (e.g. train.betas=[0.9,0.95])")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_yaml_with_base(path: str, seen: tuple = ()) -> dict:
    """A YAML config; a top-level `base: other.yaml` (relative to this file) is loaded first and overlaid."""
    data = load_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    base_path = str(Path(path).parent / base)
    if base_path in seen:
        raise ConfigError(f"config '{path}' includes itself through 'base'")
    return _deep_merge(load_yaml_with_base(base_path, seen + (base_path,)), data)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if any, with its `base`), then `key=value` overrides; validated."""
    cfg = from_dict(RunConfig, load_yaml_with_base(path) if path else {})
    cfg = apply_overrides(cfg, overrides or [])
    cfg.validate()
    return cfg
