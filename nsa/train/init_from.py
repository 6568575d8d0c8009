"""model.init_from: start a run from the weights of a checkpoint folder (e.g. one `nsa convert` wrote) or of a
Hugging Face folder (`nsa export --format hf`)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

from ..errors import UserError
from . import checkpoint


def load_initial_weights(source: str | Path, model: nn.Module) -> Path:
    """Load the weights of checkpoint folder (or run folder, or exported Hugging Face folder) `source` into the
    unwrapped `model`, after checking that every tensor is there with the model's shape. Returns the folder."""
    from ..hf.folder import is_hf_folder, load_exported_weights

    if is_hf_folder(source):
        load_exported_weights(model, source)
        return Path(source)
    try:
        path = checkpoint.resolve(source)
    except UserError as error:
        raise UserError(f"model.init_from={source} is neither a checkpoint or run folder nor a Hugging Face model "
                        f"folder ({error}); give one written by nsa train, nsa convert or nsa export --format hf"
                        ) from None
    checkpoint.verify(path)
    saved = {name.removeprefix("model."): meta.size
             for name, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if name.startswith("model.") and hasattr(meta, "size")}
    for name, tensor in model.state_dict().items():
        if name not in saved:
            raise UserError(f"model.init_from={source}: the checkpoint has no '{name}'; give a checkpoint of this "
                            "model's architecture (model.* as in its config)")
        if tuple(saved[name]) != tuple(tensor.shape):
            raise UserError(f"model.init_from={source}: '{name}' has shape {list(saved[name])} there and "
                            f"{list(tensor.shape)} in this model; set model.* to the checkpoint's values "
                            "(its train.yaml or COMPLETE.json)")
    checkpoint.load_model_weights(path, model)
    return path
