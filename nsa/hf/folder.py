"""Hugging Face model folders (config.json + model.safetensors + tokenizer files), read without transformers:
`nsa generate`, `nsa eval` and `model.init_from` take an exported folder where they take a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..model.config import ModelConfig
from ..typed_config import from_dict, to_dict
from .weights import hf_to_nsa

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
RUN_CONFIG_KEY = "nsa_run_config"
"""model.safetensors metadata: the run's resolved configuration (JSON), as `nsa export` found it."""
STEP_KEY = "nsa_step"
"""model.safetensors metadata: the training step of the exported checkpoint."""


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model folder (config.json and model.safetensors)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def read_hf_config(path: Path) -> dict:
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{Path(path) / CONFIG_FILE} cannot be read ({e}); export the model again") from None
    if not isinstance(config, dict):
        raise UserError(f"{Path(path) / CONFIG_FILE} is not a model configuration; export the model again")
    return config


def model_config_of(hf_config: dict, path: Path) -> ModelConfig:
    """The ModelConfig of a config.json: an NSA model's own section, or a Llama model's fields (dense attention)."""
    kind = hf_config.get("model_type")
    if kind == "nsa":
        return from_dict(ModelConfig, hf_config["nsa"])
    if kind != "llama":
        raise UserError(f"{path} holds a '{kind}' model; nsa reads the 'nsa' and 'llama' models that nsa export writes")
    unsupported = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "tie_word_embeddings": True}
    for key, wanted in unsupported.items():
        if hf_config.get(key, wanted) != wanted:
            raise UserError(f"{path}: {key}={hf_config[key]} has no nsa counterpart (nsa models have {key}={wanted})")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(f"{path}: RoPE scaling '{rope.get('rope_type', rope.get('type'))}' has no nsa counterpart")
    heads = hf_config["num_attention_heads"]
    return ModelConfig(
        attention="dense", vocab_size=hf_config["vocab_size"], dim=hf_config["hidden_size"],
        n_layers=hf_config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        mlp_hidden=hf_config["intermediate_size"], rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
        norm_eps=hf_config["rms_norm_eps"],
    )


def _open_weights(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path / WEIGHTS_FILE), framework="pt")
    except Exception as e:
        raise UserError(f"{path / WEIGHTS_FILE} cannot be read ({str(e).splitlines()[0] if str(e) else e}); "
                        "export the model again") from None


def _checked(path: str | Path) -> Path:
    path = Path(path)
    if not is_hf_folder(path):
        raise UserError(f"'{path}' is not a Hugging Face model folder (no {CONFIG_FILE} and {WEIGHTS_FILE}); "
                        "give a folder written by nsa export --format hf")
    return path


def read_hf_run(path: str | Path) -> tuple[ModelConfig, dict, int]:
    """(model config, run configuration, step) of an exported folder, without reading its weights. The run
    configuration is the exporting run's, with the folder's tokenizer.json as its tokenizer (data.tokenizer=hf)."""
    path = _checked(path)
    hf_config = read_hf_config(path)
    model = model_config_of(hf_config, path)
    with _open_weights(path) as f:
        metadata = f.metadata() or {}
    run = json.loads(metadata[RUN_CONFIG_KEY]) if RUN_CONFIG_KEY in metadata else {}
    run["model"] = to_dict(model)
    run.setdefault("train", {}).setdefault("seq_len", int(hf_config.get("max_position_embeddings", 2048)))
    tokenizer = path / TOKENIZER_FILE
    run.setdefault("data", {}).update(tokenizer="hf", tokenizer_path=str(tokenizer) if tokenizer.is_file() else "")
    return model, run, int(metadata.get(STEP_KEY, 0))


def read_hf_weights(path: str | Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """The Transformer state dict (tied output head included) of an exported folder's weights."""
    path = _checked(path)
    with _open_weights(path) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return hf_to_nsa(tensors, model)


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str, fix: str) -> None:
    """Copy `tensors` into `model` after checking that every name and shape matches; one-line UserError naming
    the first difference otherwise (source: where the tensors came from; fix: what to do about it)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(tensors))
    extra = sorted(set(tensors) - set(state))
    if missing or extra:
        which = f"lacks '{missing[0]}'" if missing else f"has '{extra[0]}', which this model lacks"
        raise UserError(f"{source} does not fit this model: it {which}; {fix}")
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise UserError(f"{source} does not fit this model: '{name}' is {list(tensor.shape)} there and "
                            f"{list(state[name].shape)} here; {fix}")
    with torch.no_grad():
        model.load_state_dict({k: v.to(state[k].dtype) for k, v in tensors.items()})


def load_hf_folder(path: str | Path) -> tuple[nn.Module, dict]:
    """The Transformer of an exported folder (weights loaded) and the run configuration it carries."""
    from ..model import Transformer

    cfg, run, _ = read_hf_run(path)
    model = Transformer(cfg)
    load_weights(model, read_hf_weights(path, cfg), f"{Path(path) / WEIGHTS_FILE}", "export the model again")
    return model, run


def load_exported_weights(model: nn.Module, path: str | Path) -> None:
    """model.init_from: copy an exported folder's weights into a freshly built Transformer, shapes checked."""
    if not is_hf_folder(path):
        raise UserError(f"model.init_from='{path}' is not a Hugging Face model folder (no {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE}); give a folder written by nsa export --format hf")
    cfg, _, _ = read_hf_run(path)
    load_weights(model, read_hf_weights(path, cfg), f"model.init_from='{path}'",
                 f"set the model keys to the exported model's ({cfg.attention} attention, dim {cfg.dim}, "
                 f"{cfg.n_layers} layers, vocab_size {cfg.vocab_size}; its {CONFIG_FILE})")
