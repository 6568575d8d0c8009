"""Generation: token ids with the decode cache (`generate`) or by full forward passes (`generate_uncached`),
text streamed as it is produced (`generate_text`, behind `nsa generate` and the trainer's end-of-run sample), and
rebuilding model + tokenizer from a checkpoint (`load_for_inference`)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .cache import new_cache
from .decode import prefill
from .graphed import GraphedDecoder
from .sampler import check_sampling, next_token


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    config: dict
    """The run's resolved configuration, as saved with the checkpoint."""
    path: Path

    @property
    def context(self) -> int:
        """The sequence length the model was trained at."""
        return int(self.config["train"]["seq_len"])


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} but no CUDA device is visible; use --device cpu (or auto)")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name} is unknown; choose auto, cpu or cuda") from None


def load_for_inference(checkpoint_path: str | Path, device: str | torch.device = "auto") -> LoadedModel:
    """The model (eval mode, on `device`) and tokenizer of a checkpoint folder, a run folder's latest checkpoint or
    a Hugging Face folder written by `nsa export --format hf` (its tokenizer.json as the tokenizer)."""
    from ..data.tokenizers import get_tokenizer
    from ..hf.folder import is_hf_folder, load_hf_folder
    from ..model import Transformer
    from ..model.config import ModelConfig
    from ..train import checkpoint
    from ..typed_config import from_dict

    device = resolve_device(device) if isinstance(device, str) else device
    if is_hf_folder(checkpoint_path):
        model, config = load_hf_folder(checkpoint_path)
        tokenizer = get_tokenizer(config["data"]["tokenizer"], config["data"]["tokenizer_path"])
        return LoadedModel(model.to(device).eval(), tokenizer, config, Path(checkpoint_path))
    path = checkpoint.resolve(checkpoint_path)
    config = checkpoint.read_meta(path)["config"]
    # A pinned dense kernel is the training machine's choice, not the model's: it may not exist where this runs.
    model = Transformer(dataclasses.replace(from_dict(ModelConfig, config["model"]), dense_backend="auto"))
    checkpoint.load_model_weights(path, model)
    tokenizer = get_tokenizer(config["data"]["tokenizer"], config["data"].get("tokenizer_path", ""))
    return LoadedModel(model.to(device).eval(), tokenizer, config, path)


def _prompt_list(prompt_ids) -> list[list[int]]:
    """One prompt or a batch of prompts (ids or a tensor) as a list of prompts, each of at least one token."""
    if hasattr(prompt_ids, "tolist"):  # a tensor or numpy array
        prompt_ids = prompt_ids.tolist()
    prompts = [list(prompt_ids)] if not prompt_ids or not isinstance(prompt_ids[0], Sequence) else prompt_ids
    if min(len(p) for p in prompts) < 1:
        raise UserError("every prompt needs at least one token (e.g. the end-of-text id)")
    return [list(p) for p in prompts]


def _prefill_inputs(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prefill's (tokens, cu_seqlens): prompts of one length as rows [B,T] with no boundaries, others packed back
    to back [1,total] with their boundaries (no padding)."""
    if len({len(p) for p in prompts}) == 1:
        return torch.tensor(prompts, dtype=torch.long, device=device), None
    tokens = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(len(p) for p in prompts)], dtype=torch.int32, device=device)
    return tokens, cu_seqlens


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    stop_id: int | None = None,
    compile: bool = False,
) -> list[list[int]]:
    """The new tokens of each prompt (one prompt, or a batch of any lengths), greedy when temperature == 0.

    Prompts of different lengths are prefilled as one packed forward (each its own document, no padding), then
    decoded together, each sequence at its own position.

    on_token receives each step's tokens [B] as soon as they are chosen. A sequence that produces
    stop_id ends there (stop_id is kept); generation ends when every sequence has. compile: torch.compile
    the decode step first (the same tokens; the step's many small kernels fuse, which pays back the
    compilation time over long or many generations).
    """
    check_sampling(temperature, top_p, top_k)
    device = next(model.parameters()).device
    prompts = _prompt_list(prompt_ids)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        cache = new_cache(model, len(prompts), max(map(len, prompts)) + max(max_new_tokens - 1, 0))
        tokens, cu_seqlens = _prefill_inputs(prompts, device)
        logits = prefill(model, tokens, cache, cu_seqlens)
        decoder = GraphedDecoder(model, cache, compile=compile)  # CUDA graphs on a GPU: one launch a token
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            token = next_token(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            if on_token is not None:
                on_token(token)
            for row, tok in enumerate(token.tolist()):
                if not done[row]:
                    out[row].append(tok)
                    done[row] = tok == stop_id
            if all(done) or step + 1 == max_new_tokens:
                break
            logits = decoder(token)
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def generate_uncached(
    model: nn.Module,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    context: int,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (one prompt, or a batch of one length) by one full forward pass per token
    over the last `context` tokens at most (older ones slide out).

    Slower than `generate`, but it needs nothing of the model beyond its forward, so it also runs a model
    sharded by FSDP2, whose forward is a collective: it always runs max_new_tokens forwards (no stop token),
    so every rank that calls it alike stays in step.
    """
    check_sampling(temperature, top_p, top_k)
    device = next(model.parameters()).device
    prompts = _prompt_list(prompt_ids)
    if len({len(p) for p in prompts}) > 1:
        raise ValueError(f"generate_uncached takes prompts of one length, got {[len(p) for p in prompts]}")
    tokens = torch.tensor(prompts, dtype=torch.long, device=device)
    prompt_len = tokens.shape[1]
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -context:])[:, -1]
            token = next_token(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            if on_token is not None:
                on_token(token)
            tokens = torch.cat([tokens, token[:, None]], dim=1)
    finally:
        model.train(was_training)
    return tokens[:, prompt_len:].tolist()


DEFAULT_NEW_TOKENS = 200


def check_lengths(prompt_len: int, max_new_tokens: int | None, context: int) -> int:
    """Tokens to generate: max_new_tokens, or (None) up to DEFAULT_NEW_TOKENS as the context allows.

    The prompt and what is generated must fit the context the model is run at.
    """
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_NEW_TOKENS, max(context - prompt_len, 1))
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_len > context:
        raise UserError(f"the prompt is {prompt_len} tokens but the context is {context} (the checkpoint's "
                        f"train.seq_len unless --max-context is given); shorten the prompt or raise --max-context")
    if prompt_len + max_new_tokens > context:
        raise UserError(f"the prompt ({prompt_len} tokens) plus --max-new-tokens {max_new_tokens} exceed the "
                        f"context of {context} tokens; use --max-new-tokens {context - prompt_len} or less, "
                        f"or raise --max-context")
    return max_new_tokens


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids; an empty prompt starts from end-of-text."""
    return [int(i) for i in tokenizer.encode(prompt)] or [tokenizer.eot_id]


def generate_texts(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int | None = None,
    *,
    context: int,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    compile: bool = False,
) -> list[str]:
    """The continuation of each prompt (up to end-of-text), generated together by `generate`: one packed prefill
    of the prompts, whatever their lengths, then each sequence decoded at its own position.

    Each prompt and its continuation must fit `context` tokens together; max_new_tokens None is up to
    DEFAULT_NEW_TOKENS, as many as fit after the longest prompt.
    """
    ids = [_prompt_ids(tokenizer, prompt) for prompt in prompts]
    max_new_tokens = check_lengths(max(map(len, ids)), max_new_tokens, context)
    new = generate(model, ids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   stop_id=tokenizer.eot_id, compile=compile)
    return [tokenizer.decode(tokens[:-1] if tokens and tokens[-1] == tokenizer.eot_id else tokens) for tokens in new]


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # stream: show each piece as soon as it is decoded


def generate_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int | None = None,
    *,
    context: int,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    write: Callable[[str], None] | None = None,
    compile: bool = False,
    cached: bool = True,
) -> str:
    """Write the prompt, then the continuation as it is produced (up to end-of-text); return the continuation.

    cached (`generate`): the prompt and the continuation must fit `context` tokens together; max_new_tokens None
    is up to DEFAULT_NEW_TOKENS, as many as fit. Not cached (`generate_uncached`, for a model whose forward is
    all that may be called, such as one sharded by FSDP2): each forward reads the last `context` tokens, and
    max_new_tokens None is DEFAULT_NEW_TOKENS. compile applies to the cached decode step.
    """
    write = write or _write_stdout
    ids = _prompt_ids(tokenizer, prompt)
    if cached:
        max_new_tokens = check_lengths(len(ids), max_new_tokens, context)
    elif max_new_tokens is None:
        max_new_tokens = DEFAULT_NEW_TOKENS
    elif max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_p, top_k)  # before anything is written
    new: list[int] = []
    shown = ""
    ended = False

    def stream(token: torch.Tensor) -> None:
        nonlocal shown, ended
        ended = ended or int(token[0]) == tokenizer.eot_id
        if ended:
            return
        new.append(int(token[0]))
        # A multi-byte character split across tokens decodes to U+FFFD until its last piece arrives.
        text = tokenizer.decode(new).rstrip("\ufffd")
        if text.startswith(shown) and len(text) > len(shown):
            write(text[len(shown):])
            shown = text

    write(prompt)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, on_token=stream)
    if cached:
        generate(model, ids, max_new_tokens, stop_id=tokenizer.eot_id, compile=compile, **sampling)
    else:
        generate_uncached(model, ids, max_new_tokens, context=context, **sampling)
    text = tokenizer.decode(new)
    write(text[len(shown):] + "\n" if text.startswith(shown) else "\n" + text + "\n")
    return text
