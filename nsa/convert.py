"""`nsa convert`: a dense Hugging Face LlamaForCausalLM folder (config.json + safetensors) as an NSA checkpoint.

The mapping (docs/convert.md):
- embeddings, every RMSNorm, the SwiGLU MLP (gate and up stacked into w_gate_up), the query and output
  projections: copied;
- keys and values: the dense key/value projections copied into each of the three branches (compressed,
  selected, window), so each branch starts attending with the dense model's keys and values;
- phi: the MLP phi with its last layer at zero, which computes the block mean exactly (as a fresh model does);
- gates: the gate MLP's last layer at zero, so every gate starts at sigmoid(0) = 1/2 for every token.

RoPE (rotate-half, the same base), RMSNorm and grouped-query attention have the same conventions in both models,
so with gates (compressed 0, selected 0, window 1) and a window at least the sequence length the converted model
computes the dense model's logits. What the NSA model cannot represent is refused with one line, not converted.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from .config import RunConfig
from .errors import UserError
from .hf.weights import hf_to_nsa
from .model import ModelConfig, NSAParams, Transformer
from .typed_config import apply_overrides, to_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")
"""Files of a Hugging Face folder copied next to the converted weights when present."""

LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                  "max_position_embeddings": 2048}
"""LlamaConfig's defaults for keys a config.json may leave out."""

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "recipes" / "convert.yaml"


def read_hf_config(folder: Path) -> dict:
    """config.json of a Hugging Face model folder, with LlamaConfig's defaults for missing keys."""
    if not folder.is_dir():
        raise UserError(f"'{folder}' is not a folder; give a Hugging Face model folder (config.json + *.safetensors)")
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"'{folder}' has no config.json; give a Hugging Face model folder saved by "
                        "save_pretrained") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} cannot be read as JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a model configuration")
    return LLAMA_DEFAULTS | config


def check_convertible(hf: dict) -> None:
    """UserError naming what the NSA model cannot represent in this dense config, if anything."""
    kind = hf.get("model_type")
    if kind == "qwen2":
        raise UserError("Qwen2 models have biases on their query/key/value projections, which the NSA model has "
                        "none of; only Llama-architecture models convert")
    if kind == "qwen3":
        raise UserError("Qwen3 models normalise queries and keys per head (q_norm/k_norm), which the NSA model does "
                        "not; only Llama-architecture models convert")
    if kind != "llama":
        raise UserError(f"config.json describes a '{kind}' model, not a Llama one (model_type 'llama', "
                        "LlamaForCausalLM); only Llama-architecture models convert")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if rope_type != "default":
        raise UserError(f"RoPE scaling '{rope_type}' is not supported (the NSA model uses plain RoPE); convert a model "
                        "without rope_scaling")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"{key} is true: the NSA model's projections have no biases; convert a model without them")
    if hf["hidden_act"] != "silu":
        raise UserError(f"hidden_act '{hf['hidden_act']}' is not supported (the NSA model's MLP is SwiGLU, silu)")
    if not hf["tie_word_embeddings"]:
        raise UserError("the model's output head is separate from its embeddings (tie_word_embeddings false); the "
                        "NSA model ties them, so only models with tied embeddings convert")


def model_config(hf: dict, nsa: NSAParams | None = None) -> ModelConfig:
    """The NSA ModelConfig of a (convertible) dense Llama config; `nsa` the NSA hyper-parameters (the defaults,
    M7C's, if None)."""
    try:
        n_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads)
        rope = hf.get("rope_parameters") or {}
        cfg = ModelConfig(
            attention="nsa", vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            mlp_hidden=int(hf["intermediate_size"]), rope_theta=float(rope.get("rope_theta", hf["rope_theta"])),
            norm_eps=float(hf["rms_norm_eps"]), nsa=nsa or NSAParams(),
        )
    except KeyError as e:
        raise UserError(f"config.json lacks {e.args[0]}; give the config of a LlamaForCausalLM") from None
    cfg.validate()
    return cfg


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, in float32."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"'{folder}' has no *.safetensors weights; save the model with save_pretrained "
                        "(safe_serialization=True)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update({name: t.float() for name, t in load_file(str(file)).items()})
    return tensors


def nsa_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The NSA Transformer's weights (every key but phi's and the gates') from the dense Llama ones: the dense
    model's own mapping (nsa.hf.weights), with the dense keys and values copied into every branch's set."""
    dense_cfg = dataclasses.replace(cfg, attention="dense")
    state = hf_to_nsa(weights, dense_cfg)
    with torch.device("meta"):  # the names alone: no memory for a second model
        names = list(Transformer(dense_cfg).state_dict())
    for name in names:
        if name not in state:
            raise UserError(f"the safetensors weights lack the Llama weights of '{name}'; give the weights of a "
                            "LlamaForCausalLM")
    n_sets = 1 if cfg.nsa.shared_kv else 3
    for i in range(cfg.n_layers):
        # wkv's rows are [set, key|value, kv head, head dim]; the dense wkv is one set.
        name = f"layers.{i}.attn.wkv.weight"
        state[name] = state[name].unsqueeze(0).expand(n_sets, -1, -1).reshape(-1, cfg.dim)
    state.pop("lm_head.weight", None)  # tied to tok_emb
    return state


def converted_model(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> Transformer:
    """An NSA Transformer holding the dense weights, phi at the block mean and every gate at 1/2."""
    model = Transformer(cfg)
    state, converted = model.state_dict(), nsa_state_dict(weights, cfg)
    for name, tensor in converted.items():
        if tensor.shape != state[name].shape:
            raise UserError(f"'{name}' would take a tensor of shape {list(tensor.shape)} where the model derived "
                            f"from config.json has {list(state[name].shape)}; the weights do not match config.json")
    with torch.no_grad():
        model.load_state_dict(converted, strict=False)
        for layer in model.layers:
            torch.nn.init.zeros_(layer.attn.gate.fc2.weight)  # sigmoid(0): every gate 1/2
            # phi: a fresh BlockCompressor's last layer is already zero (the block mean); said again as the contract.
            for compressor in (layer.attn.compress_k, layer.attn.compress_v):
                compressor.reset_parameters(cfg.init_std)
    return model


def convert(dense_dir: str | Path, out_dir: str | Path, overrides: list[str] | None = None) -> Path:
    """Write the NSA checkpoint folder `out_dir` from the dense Hugging Face folder `dense_dir`; `overrides` are
    `model.nsa.KEY=VALUE` settings of the NSA hyper-parameters. Returns out_dir."""
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    hf = read_hf_config(dense_dir)
    check_convertible(hf)
    nsa = _nsa_params(overrides or [])
    cfg = model_config(hf, nsa)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"'{out_dir}' already exists and is not an empty folder; choose a new output folder")
    torch.manual_seed(0)  # the gate's first layer and phi's are random: one conversion, one result
    model = converted_model(read_safetensors(dense_dir), cfg)
    tokenizer_files = tuple(dense_dir / name for name in TOKENIZER_FILES if (dense_dir / name).is_file())
    run = run_config(cfg, out_dir, has_tokenizer=(dense_dir / "tokenizer.json").is_file(),
                     context=int(hf["max_position_embeddings"]))
    meta = {"step": 0, "config": to_dict(run), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "converted_from": str(dense_dir.resolve())}
    from .train.checkpoint import save_weights

    save_weights(out_dir, model, meta, tokenizer_files)
    (out_dir / "train.yaml").write_text(train_yaml(run, out_dir), encoding="utf-8")
    return out_dir


def _nsa_params(overrides: list[str]) -> NSAParams:
    for text in overrides:
        if not text.startswith("model.nsa."):
            raise UserError(f"'{text}': nsa convert takes only model.nsa.KEY=VALUE settings "
                            "(e.g. model.nsa.window=4096)")
    return apply_overrides(RunConfig(model=ModelConfig(nsa=NSAParams())), overrides).model.nsa


def run_config(cfg: ModelConfig, out_dir: Path, has_tokenizer: bool, context: int) -> RunConfig:
    """The configuration saved with the converted weights: the model, its tokenizer (the copied tokenizer.json,
    else bytes), and train.seq_len at the dense model's context."""
    run = RunConfig(model=cfg)
    data = (dataclasses.replace(run.data, tokenizer="hf", tokenizer_path=str((out_dir / "tokenizer.json").resolve()))
            if has_tokenizer else run.data)
    return dataclasses.replace(run, data=data, train=dataclasses.replace(run.train, seq_len=context))


def train_yaml(run: RunConfig, out_dir: Path) -> str:
    """OUT_DIR/train.yaml: configs/recipes/convert.yaml (where the source tree has it) with this model, its
    tokenizer and model.init_from at the converted weights, for `nsa train OUT_DIR/train.yaml data.path=...`."""
    import yaml

    model = to_dict(run.model) | {"init_from": str(out_dir.resolve())}
    section = {"model": model, "data": {"tokenizer": run.data.tokenizer, "tokenizer_path": run.data.tokenizer_path}}
    return (f"base: {RECIPE}\n" if RECIPE.is_file() else "") + yaml.safe_dump(section, sort_keys=False)
