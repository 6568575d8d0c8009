"""The tokenizer of a run as Hugging Face files (tokenizer.json, tokenizer_config.json) that
`AutoTokenizer.from_pretrained` loads and that encode exactly as the run's own tokenizer."""

from __future__ import annotations

from pathlib import Path

from ..data.tokenizers import ByteTokenizer, GPT2Tokenizer, HFTokenizer, Tokenizer
from ..errors import UserError

EOT_TOKEN = "<|endoftext|>"
"""The end-of-text token's name in the written files (one of the names HFTokenizer looks for)."""


def byte_level_tokenizer():
    """A tokenizers-library tokenizer mapping each UTF-8 byte b to id b, plus end-of-text as id 256 (ByteTokenizer).

    Byte-level pre-tokenization without the GPT-2 split turns the text into one piece of byte symbols; a BPE with
    no merges then emits one id per byte.
    """
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TOKEN])
    return tok


def gpt2_tokenizer(ranks_file: str):
    """GPT-2's BPE from its tiktoken ranks file, through transformers' own tiktoken converter."""
    from tiktoken_ext.openai_public import r50k_pat_str
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter(vocab_file=ranks_file, pattern=r50k_pat_str,
                             extra_special_tokens=[EOT_TOKEN]).converted()


def backend_tokenizer(tokenizer: Tokenizer):
    """The tokenizers-library tokenizer that encodes as `tokenizer` does (byte, gpt2 or hf)."""
    if isinstance(tokenizer, ByteTokenizer):
        return byte_level_tokenizer()
    if isinstance(tokenizer, GPT2Tokenizer):
        return gpt2_tokenizer(str(tokenizer.ranks_file))
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend
    raise UserError(f"tokenizer '{getattr(tokenizer, 'name', tokenizer)}' has no Hugging Face form; "
                    "use data.tokenizer=byte, gpt2 or hf")


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for `tokenizer` into the folder `out`."""
    from transformers import PreTrainedTokenizerFast

    backend = backend_tokenizer(tokenizer)
    eot = backend.id_to_token(tokenizer.eot_id)
    # End-of-text doubles as padding: padded batches need a pad token, and padding is masked out, so its id does
    # not matter.
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eot, bos_token=eot, pad_token=eot,
                                   unk_token=None, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
