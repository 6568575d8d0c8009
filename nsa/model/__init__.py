"""The NSA language model: configuration, layers and the transformer."""

from .attention import DenseAttention, NSAAttention
from .config import PRESETS, ModelConfig, NSAParams, m7c, preset, tiny
from .transformer import Transformer

__all__ = [
    "DenseAttention",
    "ModelConfig",
    "NSAAttention",
    "NSAParams",
    "PRESETS",
    "Transformer",
    "m7c",
    "preset",
    "tiny",
]
