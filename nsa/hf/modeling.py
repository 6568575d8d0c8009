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
from .padding import PackedRows, next_token_targets, pack_rows
from .remote_code import AUTO_MAP, write_remote_code


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

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """config.json with an auto_map, and the two files it names (nsa.hf.remote_code): the folder then loads
        without importing nsa first, given trust_remote_code=True."""
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_remote_code(save_directory)


class NSACache(Cache):
    """nsa's DecodeCache (raw keys/values per branch, compressed stream, selection band) for generate().

    The DecodeCache keeps each sequence's own length (a padded prompt holds only its tokens); `seen` counts the
    columns of input_ids taken in, padding included: the sequence length generate() works with.
    """

    def __init__(self, decode: DecodeCache):
        super().__init__(layers=[])
        self.decode = decode
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.decode.max_len

    @property
    def is_compileable(self) -> bool:
        return False


class NSAForCausalLM(PreTrainedModel, GenerationMixin):
    """nsa.model.Transformer under `model`, as a causal language model for transformers.

    generate() prefills the prompts into an NSACache sized for max_position_embeddings tokens, then decodes one
    token at a time through nsa.inference (logits equal to the full forward's). A padded batch (attention_mask with
    zeros at the start or the end of rows) runs as packed documents (nsa.hf.padding): each row's logits and cache are
    those of the row alone, its padding gets zero logits and no loss.
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
        if labels is not None or not use_cache:  # a plain call (use_cache None) is the full forward
            rows = pack_rows(input_ids, attention_mask)
            logits = self._logits(input_ids, rows)
            loss = None
            if labels is not None:
                targets = next_token_targets(labels, rows)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        cache = past_key_values if isinstance(past_key_values, NSACache) and past_key_values.seen else None
        if cache is None:
            rows = pack_rows(input_ids, attention_mask)
            self._check_room(input_ids.shape[1] if rows is None else int(rows.real.sum(1).max()))
            cache = NSACache(new_cache(self.model, input_ids.shape[0], self.config.max_position_embeddings))
            last = (prefill(self.model, input_ids, cache.decode) if rows is None
                    else prefill(self.model, rows.tokens, cache.decode, rows.cu_seqlens))
            logits = last[:, None] if logits_to_keep == 1 else self._logits(input_ids, rows)
        else:  # each sequence continues at its own length; the mask's padding is already left out of the cache
            self._check_room(cache.decode.longest + input_ids.shape[1])
            logits = torch.stack([decode_step(self.model, token, cache.decode) for token in input_ids.unbind(1)], 1)
        cache.seen += input_ids.shape[1]
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    def _check_room(self, tokens: int) -> None:
        """One-line ValueError when a sequence would outgrow the decode cache (max_position_embeddings tokens)."""
        room = self.config.max_position_embeddings
        if tokens > room:
            raise ValueError(f"a sequence of {tokens} tokens does not fit the decode cache of max_position_embeddings="
                             f"{room} tokens (the trained context); load the model with max_position_embeddings="
                             f"{tokens} or more to decode further (lm_eval: --model_args ...,max_position_embeddings=N)")

    def _logits(self, input_ids: torch.Tensor, rows: PackedRows | None) -> torch.Tensor:
        if rows is None:
            return self.model(input_ids)
        return rows.unpack(self.model(rows.tokens, cu_seqlens=rows.cu_seqlens))

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Cache | None = None,
                                      attention_mask: torch.Tensor | None = None, **kwargs) -> dict:
        """The tokens the cache does not hold yet."""
        if isinstance(past_key_values, NSACache) and past_key_values.seen:
            input_ids = input_ids[:, past_key_values.seen:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                "use_cache": kwargs.get("use_cache"), "logits_to_keep": kwargs.get("logits_to_keep", 0)}
