"""`nsa export RUN_OR_CHECKPOINT OUT_DIR --format hf`: a checkpoint as a Hugging Face model folder.

An NSA model becomes an NSAForCausalLM folder (transformers loads it once nsa is imported, or with
trust_remote_code=True through the folder's configuration_nsa.py and modeling_nsa.py); a dense model becomes a
stock LlamaForCausalLM folder that plain transformers loads (docs/interop.md has the mapping). Both get
config.json, model.safetensors, generation_config.json and the run's tokenizer as tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..model.config import ModelConfig
from ..storage import write_error
from .folder import RUN_CONFIG_KEY, STEP_KEY, WEIGHTS_FILE
from .weights import nsa_to_hf


def hf_config(cfg: ModelConfig, context: int, eot_id: int):
    """The transformers configuration of a model: LlamaConfig for dense attention, NSAConfig for NSA."""
    common = dict(max_position_embeddings=context, bos_token_id=eot_id, eos_token_id=eot_id, tie_word_embeddings=True)
    if cfg.attention == "nsa":
        from ..typed_config import to_dict
        from .modeling import NSAConfig

        return NSAConfig(nsa=to_dict(cfg), architectures=["NSAForCausalLM"], **common)
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=False, mlp_bias=False,
        architectures=["LlamaForCausalLM"], **common,
    )


def export_hf(checkpoint_path: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face folder `out` (new or empty) of a checkpoint or a run folder's latest checkpoint."""
    try:
        from transformers import GenerationConfig
    except ImportError:
        raise UserError('--format hf needs transformers: pip install "nsa[hf]" (or pip install transformers)') from None
    from safetensors.torch import save_file

    from ..data.tokenizers import get_tokenizer
    from ..model import Transformer
    from ..train import checkpoint
    from ..typed_config import from_dict
    from .tokenizer_files import save_tokenizer

    path = checkpoint.resolve(checkpoint_path)
    meta = checkpoint.read_meta(path)
    config = meta["config"]
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' exists and is not an empty folder; choose a new output folder for --format hf")
    cfg = from_dict(ModelConfig, config["model"])
    model = Transformer(cfg)
    checkpoint.load_model_weights(path, model)
    tokenizer = get_tokenizer(config["data"]["tokenizer"], config["data"].get("tokenizer_path", ""))
    eot = tokenizer.eot_id
    try:
        out.mkdir(parents=True, exist_ok=True)
        hf_config(cfg, int(config["train"]["seq_len"]), eot).save_pretrained(str(out))
        generation = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False)
        generation.save_pretrained(str(out))
        save_file(nsa_to_hf(model.state_dict(), dense=cfg.attention == "dense"), str(out / WEIGHTS_FILE),
                  metadata={"format": "pt", RUN_CONFIG_KEY: json.dumps(config), STEP_KEY: str(meta["step"])})
        save_tokenizer(tokenizer, out)
    except OSError as e:
        raise write_error(e, out, "choose another output folder") from e
    return out
