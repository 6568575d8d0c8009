"""Checkpoints: torch.distributed.checkpoint (DCP) for model and optimizer, one small file per rank
for the rest (step, schedule, RNG, data position).

A checkpoint is written into a temporary folder; only after every rank has finished does
rank 0 mark it complete and rename it to checkpoints/step_NNNNNNNN, so a crash or Ctrl-C
mid-save leaves the previous checkpoint as the latest usable one. Older ones beyond
`keep` are removed. The same folders load into any parallel layout (DCP reshards), and
`export_safetensors` consolidates the weights for inference.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import UserError
from .distributed import DistInfo, barrier

COMPLETE = "COMPLETE.json"


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns that it "assumes the intent is to save in a single process" when there is no process group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield
PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank_state: dict, meta: dict,
         info: DistInfo, keep: int = 0) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rank_state, tmp / f"rank{info.rank}.pt")
    barrier(info)
    if info.is_main:
        (tmp / COMPLETE).write_text(json.dumps(meta | {"world_size": info.world_size}, indent=1))
        _fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if keep > 0:
            for old in completed(path.parent)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return path


def completed(folder: Path) -> list[Path]:
    """Complete checkpoints in a checkpoints/ folder, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"{PREFIX}*") if (p / COMPLETE).is_file())


def latest(run_dir: Path) -> Path | None:
    found = completed(Path(run_dir) / "checkpoints")
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its latest checkpoint)."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    found = latest(path)
    if found is None:
        raise UserError(f"no complete checkpoint at '{path}' (expected a run folder or checkpoints/{PREFIX}NNNNNNNN)")
    return found


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / COMPLETE).read_text())


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict | None:
    """Collective. Loads model and optimizer in place; returns this rank's saved state (None if the
    checkpoint was written with a different number of ranks, which loses the exact data position)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_file = Path(path) / f"rank{info.rank}.pt"
    if read_meta(path).get("world_size") != info.world_size or not rank_file.is_file():
        return None
    return torch.load(rank_file, map_location="cpu", weights_only=False)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Weights only, into an unwrapped model on one process (inference, export)."""
    state = {"model": model.state_dict()}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])


def export_safetensors(path: str | Path, out: str | Path) -> Path:
    """Consolidate a checkpoint's weights into one safetensors file (tied output weights stored once)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("export needs the safetensors package: pip install safetensors") from None
    from ..model import Transformer
    from ..model.config import ModelConfig
    from ..typed_config import from_dict

    path = resolve(path)
    cfg = from_dict(ModelConfig, read_meta(path)["config"]["model"])
    model = Transformer(cfg)
    load_model_weights(path, model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = Path(out)
    save_file(tensors, str(out), metadata={"nsa_config": json.dumps(read_meta(path)["config"])})
    return out
