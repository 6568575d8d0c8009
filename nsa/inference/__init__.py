"""Inference: decode caches, prefill and one-token decode steps, sampling and text generation."""

from .attention import decode_attention, dense_decode_attention
from .cache import DecodeCache, DenseLayerCache, NSALayerCache, new_cache
from .decode import compiled_decode_step, decode_step, prefill
from .generate import (
    generate,
    generate_text,
    generate_texts,
    generate_uncached,
    load_for_inference,
)
from .graphed import GraphedDecoder

__all__ = [
    "DecodeCache",
    "DenseLayerCache",
    "GraphedDecoder",
    "NSALayerCache",
    "compiled_decode_step",
    "decode_attention",
    "decode_step",
    "dense_decode_attention",
    "generate",
    "generate_text",
    "generate_texts",
    "generate_uncached",
    "load_for_inference",
    "new_cache",
    "prefill",
]
