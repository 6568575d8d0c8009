"""The bytes a decode step must read, and the time reading them takes at the device's memory bandwidth: the floor
`nsa bench decode` compares each measured step and each layer's attention with.

A decode step of B sequences at context T reads every weight once (the tied embedding once, as the output head)
and, per layer, each sequence's cache entries its attention needs:
- dense attention: the keys and values of all T positions;
- NSA: the compressed keys and values (Nc(T) of them; scoring the blocks and the compressed branch read the same
  ones), the keys and values of the n selected blocks of l' tokens, and those of the last w tokens.
Selected blocks and the window may overlap; a kernel reading each once would read a little less, so NSA's floor is
an upper bound by at most the window. Activations are left out: at decode they are a few kilobytes per sequence.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..model.config import ModelConfig
from ..ops.geometry import num_compressed_blocks


def attention_tokens(cfg: ModelConfig, context: int) -> int:
    """Cache positions (each a key and a value per kv head) one sequence's decode attention reads in one layer."""
    if cfg.attention != "nsa":
        return context
    nsa = cfg.nsa
    return (num_compressed_blocks(context, nsa.block_len, nsa.block_stride) + min(nsa.n_sel * nsa.sel_block, context)
            + min(nsa.window, context))


def attention_bytes(cfg: ModelConfig, context: int, batch: int, element_size: int) -> int:
    """Bytes one layer's decode attention reads for `batch` sequences at `context` tokens."""
    return batch * attention_tokens(cfg, context) * 2 * cfg.n_kv_heads * cfg.head_dim * element_size


def step_bytes(model: nn.Module, context: int, batch: int) -> int:
    """Bytes one decode step of `model` reads: every weight once and each layer's attention reads."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once
    element_size = next(model.parameters()).element_size()
    return weights + model.cfg.n_layers * attention_bytes(model.cfg, context, batch, element_size)


def copy_bandwidth(device: torch.device, megabytes: int = 512, reps: int = 10) -> float:
    """Bytes per second the device moves in a large copy (read + write counted), the rate the floor assumes."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            target.copy_(source)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            target.copy_(source)
        seconds = time.perf_counter() - t0
    return 2 * source.numel() * reps / seconds
