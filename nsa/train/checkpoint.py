"""Checkpoints: torch.distributed.checkpoint (DCP) for model and optimizer, one small file per rank
for the rest (step, schedule, RNG, data position).

A checkpoint is written into a temporary folder; only after every rank has finished does
rank 0 mark it complete and rename it to checkpoints/step_NNNNNNNN, so a crash, a full disk or
Ctrl-C mid-save leaves the previous checkpoint as the latest usable one. Older ones beyond
`keep` are removed. The same folders load into any parallel layout (DCP reshards), and
`export_safetensors` consolidates the weights for inference.

COMPLETE.json records the size of every piece (and a CRC32 of the small ones: DCP's metadata and
the per-rank files), so a truncated or damaged checkpoint is named before anything loads from it.
Bit errors inside tensor data are not checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import UserError
from ..storage import DamagedFile, write_error
from .distributed import DistInfo, any_rank

COMPLETE = "COMPLETE.json"
TENSOR_DATA_SUFFIX = ".distcp"
"""DCP's tensor files: sized, not checksummed (reading them whole would double the time to load)."""


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
    """Collective: every rank calls it. Returns the final folder. A failed write (full disk, read-only folder)
    raises UserError on every rank and leaves the previous checkpoints as they were."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    _agreed_write(info, path, tmp, lambda: _fresh_folder(tmp) if info.is_main else None)
    model_sd, optim_sd = get_state_dict(model, optimizer)

    def write_pieces() -> None:
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rank_state, tmp / f"rank{info.rank}.pt")

    _agreed_write(info, path, tmp, write_pieces)
    _agreed_write(info, path, tmp, lambda: _complete(tmp, path, meta | {"world_size": info.world_size}, keep)
                  if info.is_main else None)
    return path


def save_weights(path: Path, model: nn.Module, meta: dict, extra_files: tuple[Path, ...] = ()) -> Path:
    """A checkpoint of weights only (no optimizer or per-rank state), written on one process: what generation,
    evaluation, export and model.init_from read (checkpoint.resume needs a checkpoint the trainer wrote).
    `extra_files` are copied in and recorded with the pieces. The folder appears complete or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _fresh_folder(tmp)
        with _quiet_single_process():
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp))
        for file in extra_files:
            shutil.copy2(file, tmp / Path(file).name)
        _complete(tmp, path, meta | {"world_size": 1}, keep=0)
    except (Exception, dcp.CheckpointException) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, path, "choose another output folder") from e
    return path


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _complete(tmp: Path, path: Path, meta: dict, keep: int) -> None:
    """Rank 0, after every rank wrote its pieces: record them, mark the folder complete, move it into place."""
    (tmp / COMPLETE).write_text(json.dumps(meta | {"files": _piece_records(tmp)}, indent=1))
    _fsync_dir(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if keep > 0:
        for old in completed(path.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _agreed_write(info: DistInfo, path: Path, tmp: Path, write) -> None:
    """Run this rank's part of saving checkpoint `path` (in `tmp`); if it fails on any rank, drop the unfinished
    folder and raise on every rank (no rank is left waiting in the next collective)."""
    error = None
    try:
        write()
    except (Exception, dcp.CheckpointException) as e:  # DCP's exception is a BaseException; torch.save raises
        error = e                                           # RuntimeError on a full disk
    if not any_rank(error is not None, info):
        return
    previous = latest(path.parent.parent)
    fix = (f"the latest complete checkpoint, {previous}, is intact: fix this, then run the same command to "
           "resume from it" if previous else "no complete checkpoint was written yet")
    # Judged before the unfinished folder is removed: a full disk shows only while the folder fills it.
    failure = (write_error(error, path, fix) if error is not None else
               UserError(f"another rank could not write checkpoint {path}; {fix}"))
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    raise failure from error


def _piece_records(folder: Path) -> dict[str, dict]:
    """{file name: {'bytes': size, 'crc32': checksum (small pieces only)}} of a checkpoint folder's pieces."""
    records = {}
    for piece in sorted(folder.iterdir()):
        if piece.is_file() and piece.name != COMPLETE:
            record = {"bytes": piece.stat().st_size}
            if piece.suffix != TENSOR_DATA_SUFFIX:
                record["crc32"] = zlib.crc32(piece.read_bytes())
            records[piece.name] = record
    return records


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
    """COMPLETE.json of a checkpoint: its step, config, world size and pieces."""
    marker = Path(path) / COMPLETE
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(path, f"{marker} cannot be read ({_reason(e)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise _damaged(path, f"{marker} does not describe a checkpoint")
    return meta


def verify(path: Path) -> dict:
    """The checkpoint's metadata, after checking that every piece it records is present and whole."""
    meta = read_meta(path)
    for name, record in meta.get("files", {}).items():
        piece = Path(path) / name
        if not piece.is_file():
            raise _damaged(path, f"{piece} is missing")
        size = piece.stat().st_size
        if size != record["bytes"]:
            raise _damaged(path, f"{piece} holds {size:,} bytes where {record['bytes']:,} were written")
        if "crc32" in record and zlib.crc32(piece.read_bytes()) != record["crc32"]:
            raise _damaged(path, f"{piece} does not match its checksum")
    return meta


def _damaged(path: Path, problem: str) -> DamagedFile:
    path = Path(path)
    earlier = [p for p in completed(path.parent) if p.name < path.name]
    fix = (f"use the previous checkpoint {earlier[-1]} (to resume training from it: checkpoint.resume={earlier[-1]})"
           if earlier else "no earlier checkpoint is kept; start over with checkpoint.resume=none")
    return DamagedFile(f"checkpoint {path} is damaged: {problem}; {fix}")


def _reason(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, dcp.CheckpointException) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise _damaged(path, f"its tensors cannot be loaded ({lines[-1] if lines else type(e).__name__})") from None


def _torch_load(file: Path, path: Path) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:
        raise _damaged(path, f"{file} cannot be read ({_reason(e)})") from None


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict | None:
    """Collective. Loads model and optimizer in place; returns this rank's saved state (None if the
    checkpoint was written with a different number of ranks, which loses the exact data position)."""
    meta = verify(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_file = Path(path) / f"rank{info.rank}.pt"
    if meta.get("world_size") != info.world_size or not rank_file.is_file():
        return None
    return _torch_load(rank_file, path)


def load_rank_state(path: Path, rank: int) -> dict:
    """The saved state of one rank (step, schedule, RNG, data position)."""
    return _torch_load(Path(path) / f"rank{rank}.pt", path)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Weights only, into an unwrapped model on one process (inference, export)."""
    verify(path)
    state = {"model": model.state_dict()}
    _dcp_load(state, path)
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
    meta = read_meta(path)
    cfg = from_dict(ModelConfig, meta["config"]["model"])
    model = Transformer(cfg)
    load_model_weights(path, model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = Path(out)
    try:
        save_file(tensors, str(out), metadata={"nsa_config": json.dumps(meta["config"])})
    except Exception as e:
        out.unlink(missing_ok=True)
        raise write_error(e, out, "choose another output path") from e
    return out
