"""Process-group plumbing: ranks come from the launcher (torchrun), never from our config.

Every rank logs who it is at start; a single process on a machine with several GPUs is an
error unless allowed; ranks that disagree on the configuration stop before training; all
collectives have a timeout so a lost rank fails the job instead of hanging it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import UserError


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _launcher_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) as set by torchrun; (0, 0, 1) for a plain process."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def _device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(f"train.device='{requested}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train.device='{requested}' but no CUDA GPU is available; use train.device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def init_distributed(device: str, timeout_s: float, allow_single_process: bool) -> DistInfo:
    rank, local_rank, world = _launcher_env()
    dev = _device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world == 1 and gpus > 1 and dev.type == "cuda" and not allow_single_process:
        raise UserError(
            f"{gpus} GPUs are visible but this is a single process; launch one process per GPU with "
            f"`torchrun --nproc_per_node={gpus} -m nsa train ...` (or set parallel.allow_single_process=true)"
        )
    info = DistInfo(rank, local_rank, world, dev)
    if info.distributed:  # a single process reports its device in the training banner
        print(f"[rank {rank}] local rank {local_rank}, world size {world}, device {dev}, host {socket.gethostname()}",
              file=sys.stderr, flush=True)
    return info


def check_same_config(config: dict, info: DistInfo) -> None:
    """Fail on every rank, with the differing keys named, if the ranks resolved different configs."""
    if not info.distributed:
        return
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, (digest, config))
    mismatched = [r for r, (d, _) in enumerate(gathered) if d != gathered[0][0]]
    if mismatched:
        other = gathered[mismatched[0]][1]
        keys = _differing_keys(gathered[0][1], other)
        raise UserError(f"ranks disagree on the config: rank {mismatched[0]} differs from rank 0 in "
                        f"{', '.join(keys[:5])}; give every rank the same config and overrides")


def _differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        name = f"{prefix}{key}"
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            out += _differing_keys(a[key], b[key], name + ".")
        elif a.get(key) != b.get(key):
            out.append(name)
    return out


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if `flag` is true on any rank (every rank must call this)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo, finished: bool = True) -> None:
    """Leave the process group. After a normal finish, wait for every rank first (a rank that leaves
    early would abort the others' last collectives). After an error, leave at once: the other ranks may
    be inside a collective this one will never join, and waiting would hang until the timeout; this
    rank's non-zero exit makes torchrun stop them."""
    if not (info.distributed and dist.is_initialized()):
        return
    if finished:
        # DDP/FSDP modules in reference cycles would keep the process group, and gloo's worker threads with
        # their tensors, alive until interpreter teardown, where freeing them aborts the process
        # ("terminate called without an active exception"). Free them while Python is whole.
        gc.collect()
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
