"""Parallelism applied from outside the model: activation checkpointing, torch.compile, DDP or FSDP2."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from ..errors import UserError
from .config import ParallelConfig
from .distributed import DistInfo


# Inductor's coalescing analysis (it only picks tile shapes) asserts on a reduction whose epilogue
# broadcasts the reduced row over another axis, which the NSA block has when compiled without activation
# checkpointing (pytorch/pytorch#197077); turning it off changes no result.
INDUCTOR_OPTIONS = {"triton.coalesce_tiling_analysis": False}


def resolve_mode(cfg: ParallelConfig, info: DistInfo) -> str:
    if cfg.mode == "auto":
        return "ddp" if info.distributed else "single"
    if cfg.mode in ("ddp", "fsdp") and not info.distributed:
        raise UserError(f"parallel.mode={cfg.mode} needs several processes: launch with "
                        f"`torchrun --nproc_per_node=N -m nsa train ...` (or use parallel.mode=single)")
    if cfg.mode == "single" and info.distributed:
        raise UserError("parallel.mode=single but several processes were launched; use parallel.mode=ddp or fsdp")
    return cfg.mode


def apply_parallelism(model: nn.Module, cfg: ParallelConfig, info: DistInfo, mode: str, bf16: bool) -> nn.Module:
    """Wrap blocks for recomputation and compilation (the loss is compiled too), then replicate (DDP) or shard
    (FSDP2) the model. 'auto' settings are decided here for `mode` and the device (ParallelConfig.resolved; a
    no-op on a config the Trainer already resolved), so no caller can hand the string 'auto' to Inductor."""
    cfg = cfg.resolved(mode, info.device.type)
    cfg.check_cudagraphs(mode, info.device.type)
    layers = model.layers
    options = {**INDUCTOR_OPTIONS, "triton.cudagraphs": cfg.cudagraphs}
    for i, block in enumerate(layers):
        if cfg.activation_checkpointing:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if cfg.compile:
            block.compile(options=options)
        layers[i] = block
    if cfg.compile:
        model.loss.compile(options=options)
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 parameters for compute, fp32 master weights in the optimizer; gradients reduced in fp32 by default.
        reduce_dtype = getattr(torch, cfg.fsdp_reduce_dtype)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
        kwargs = {"mp_policy": mp}
        for block in layers:
            fully_shard(block, reshard_after_forward=cfg.fsdp_reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return model


@contextlib.contextmanager
def uncompiled(model: nn.Module):
    """Run the modules that apply_parallelism compiled as plain eager code for a while: the end-of-run sample
    calls the model at a new length per token, which would recompile (and under parallel.cudagraphs record a
    graph) for each."""
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    saved = [m._compiled_call_impl for m in compiled]
    for m in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in zip(compiled, saved):
            m._compiled_call_impl = impl


def unwrap(model: nn.Module) -> nn.Module:
    """The Transformer inside a DDP wrapper (FSDP2 shards in place, so it is already the model)."""
    return model.module if hasattr(model, "module") and not hasattr(model, "layers") else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, mode: str, enabled: bool):
    """Reduce gradients across ranks only on the last micro-batch of an accumulation."""
    if mode == "ddp" and not enabled:
        with model.no_sync():
            yield
    elif mode == "fsdp":
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield
