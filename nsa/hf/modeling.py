"""NSAConfig and NSAForCausalLM: the nsa Transformer as a Hugging Face model (needs transformers: pip install
"nsa[hf]"). The model is nsa.model.Transformer itself; generate() decodes through nsa's per-branch decode cache
(nsa.inference), held in an NSACache."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..inference.cache import DecodeCache, new_cache
from ..inference.decode import decode_step, prefill
from ..model import Transformer
from ..model.config import ModelConfig
from ..typed_config import from_dict, to_dict


class NSAConfig(PretrainedConfig):
    """An nsa model's configuration: its ModelConfig under `nsa`, and the usual Hugging Face names derived from it."""

    model_type = "nsa"

    def __init__(self, nsa: dict | None = None, max_position_embeddings: int = 2048, **kwargs):
        cfg = from_dict(ModelConfig, nsa or {})
        if cfg.vocab_size < 1:
            cfg.vocab_size = kwargs.pop("vocab_size", 0) or 64
        kwargs.pop("vocab_size", None)
        self.nsa = to_dict(dataclasses.replace(cfg, dense_backend="auto"))
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.dim
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads
        self.num_key_value_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.use_cache = kwargs.pop("use_cache", True)
        kwargs["tie_word_embeddings"] = True  # the Transformer's output head is its embedding
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return from_dict(ModelConfig, self.nsa)


class NSACache(Cache):
    """nsa's DecodeCache (raw keys/values per branch, compressed stream, selection band) for generate()."""

    def __init__(self, decode: DecodeCache):
        super().__init__(layers=[])
        self.decode = decode

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.decode.longest

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.decode.max_len

    @property
    def is_compileable(self) -> bool:
        return False


class NSAForCausalLM(PreTrainedModel, GenerationMixin):
    """nsa.model.Transformer under `model`, as a causal language model for transformers.

    generate() prefills the prompts into an NSACache sized for max_position_embeddings tokens, then decodes one
    token at a time through nsa.inference (logits equal to the full forward's). Prompts of a batch must be of one
    length (no padding: attention_mask all ones).
    """

    config_class = NSAConfig
    base_model_prefix = "nsa"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}
    _supports_cache_class = True

    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.model = Transformer(config.model_config)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The Transformer initialises its own weights; loading replaces them."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_emb

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits of input_ids [B,T]; with labels, the mean next-token loss (labels shifted inside, -100 ignored);
        with use_cache, the prompts go into (or continue) an NSACache, returned as past_key_values."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("NSAForCausalLM takes no padding: give prompts of one length (attention_mask all ones)")
        if labels is not None or not use_cache:  # a plain call (use_cache None) is the full forward
            logits = self.model(input_ids)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        cache = past_key_values if isinstance(past_key_values, NSACache) and past_key_values.decode.longest else None
        if cache is None:
            cache = NSACache(new_cache(self.model, input_ids.shape[0], self.config.max_position_embeddings))
            last = prefill(self.model, input_ids, cache.decode)
            logits = last[:, None] if logits_to_keep == 1 else self.model(input_ids)
        else:
            logits = torch.stack([decode_step(self.model, token, cache.decode) for token in input_ids.unbind(1)], 1)
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Cache | None = None,
                                      attention_mask: torch.Tensor | None = None, **kwargs) -> dict:
        """The tokens the cache does not hold yet."""
        if isinstance(past_key_values, NSACache) and past_key_values.decode.longest:
            input_ids = input_ids[:, past_key_values.get_seq_length():]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                "use_cache": kwargs.get("use_cache"), "logits_to_keep": kwargs.get("logits_to_keep", 0)}
