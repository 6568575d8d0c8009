"""Single-process training: data, model, AdamW, schedule, validation, metrics, checkpoint, sample."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from ..config import RunConfig
from ..data.packing import ShuffledBatches, TokenWindows, build_splits
from ..data.tokenizers import Tokenizer, get_tokenizer, padded_vocab_size
from ..errors import UserError
from ..model import Transformer
from ..model.sampling import sample
from ..telemetry.metrics import MetricsCSV
from ..typed_config import to_dict
from . import checkpoint
from .optim import build_optimizer, build_scheduler

METRIC_FIELDS = ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"]


@dataclass
class TrainResult:
    run_dir: Path
    first_loss: float
    last_loss: float
    val_loss: float | None
    checkpoint: Path
    sample: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device='{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device='{name}' but no CUDA GPU is available; use train.device=cpu")
    return device


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast on GPU under precision 'auto' or 'bf16'; plain fp32 otherwise."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_vocab(cfg: RunConfig, tokenizer: Tokenizer) -> RunConfig:
    vocab = cfg.model.vocab_size or padded_vocab_size(tokenizer.vocab_size)
    if vocab < tokenizer.vocab_size:
        raise UserError(
            f"model.vocab_size={vocab} is smaller than the '{tokenizer.name}' tokenizer's "
            f"{tokenizer.vocab_size} tokens; set model.vocab_size=0 to size it from the tokenizer"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def make_run_dir(cfg: RunConfig) -> Path:
    name = cfg.train.run_name or f"{cfg.model.attention}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.train.out_dir) / name
    suffix = 1
    while run_dir.exists() and not cfg.train.run_name:
        suffix += 1
        run_dir = Path(cfg.train.out_dir) / f"{name}-{suffix}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return run_dir


@torch.no_grad()
def evaluate(model, windows: TokenWindows, cfg: RunConfig, device, autocast) -> float:
    """Mean loss over the first eval_batches micro-batches of held-out windows (always the same ones)."""
    model.eval()
    bs = cfg.train.batch_size
    losses = []
    for b in range(min(cfg.train.eval_batches, math.ceil(len(windows) / bs))):
        x, y = windows.batch(list(range(b * bs, min(len(windows), (b + 1) * bs))))
        with autocast():
            losses.append(model(x.to(device), y.to(device)).float())
    model.train()
    return torch.stack(losses).mean().item()


def train_step(model, optimizer, scheduler, windows, sampler, cfg: RunConfig, device, autocast):
    """One optimizer step over grad_accum micro-batches; returns (loss, grad_norm) as device tensors."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for _ in range(cfg.train.grad_accum):
        x, y = windows.batch(sampler.next_indices())
        with autocast():
            loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) / cfg.train.grad_accum
        loss.backward()
        total += loss.detach()
    clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    return total, grad_norm


def _log(bar: tqdm | None, message: str) -> None:
    (bar.write if bar is not None else print)(message)


def train(cfg: RunConfig) -> TrainResult:
    """Train the configured model on one device; see TrainConfig for every knob."""
    t = cfg.train
    device = resolve_device(t.device)
    autocast = lambda: autocast_context(t.precision, device)  # noqa: E731
    torch.manual_seed(t.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = get_tokenizer(cfg.data.tokenizer)
    cfg = resolve_vocab(cfg, tokenizer)
    train_windows, val_windows = build_splits(cfg.data, tokenizer, t.seq_len)
    model = Transformer(cfg.model).to(device)
    optimizer = build_optimizer(model, t, device)
    scheduler = build_scheduler(optimizer, t)
    sampler = ShuffledBatches(len(train_windows), t.batch_size, t.seed)
    run_dir = make_run_dir(cfg)
    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len

    print(
        f"nsa train: {cfg.model.attention} model, {model.num_parameters() / 1e6:.2f}M parameters, "
        f"{cfg.model.n_layers} layers, dim {cfg.model.dim}, {cfg.model.n_heads}/{cfg.model.n_kv_heads} heads"
    )
    print(
        f"data: {cfg.data.source} ({tokenizer.name} tokens), {len(train_windows.tokens):,} train / "
        f"{len(val_windows.tokens) if val_windows else 0:,} val tokens; {tokens_per_step:,} tokens per step"
    )
    print(f"device: {device}, run dir: {run_dir}")

    metrics = MetricsCSV(run_dir / "metrics.csv", METRIC_FIELDS)
    bar = tqdm(total=t.steps, desc="train", dynamic_ncols=True, file=sys.stdout) if t.progress else None
    first_loss = last_loss = val_loss = None
    start = last_time = time.perf_counter()
    last_step = 0
    step = 0

    def save(step: int) -> Path:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "step": step,
            "config": to_dict(cfg),
        }
        return checkpoint.save_atomic(state, checkpoint.checkpoint_path(run_dir, step))

    try:
        for step in range(1, t.steps + 1):
            loss, grad_norm = train_step(model, optimizer, scheduler, train_windows, sampler, cfg, device, autocast)
            if bar is not None:
                bar.update(1)
            is_last = step == t.steps
            do_eval = val_windows is not None and t.eval_every > 0 and (step % t.eval_every == 0 or is_last)
            if not (step == 1 or step % t.log_every == 0 or do_eval or is_last):
                continue
            # Host syncs happen only here, on logging steps.
            last_loss = loss.item()
            first_loss = last_loss if first_loss is None else first_loss
            if not math.isfinite(last_loss):
                path = save(step)
                raise UserError(
                    f"loss became {last_loss} at step {step} (checkpoint {path}); lower train.lr or check the data"
                )
            now = time.perf_counter()
            tok_s = (step - last_step) * tokens_per_step / max(now - last_time, 1e-9)
            last_time, last_step = now, step
            val_loss = evaluate(model, val_windows, cfg, device, autocast) if do_eval else None
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "loss": last_loss,
                "val_loss": val_loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tok_s,
                "elapsed_s": now - start,
            }
            metrics.write(row)
            if bar is not None:
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tok_s:,.0f}")
            else:
                _log(None, f"step {step}/{t.steps} loss {last_loss:.4f} tok/s {tok_s:,.0f}")
            if val_loss is not None:
                _log(bar, f"step {step}: val loss {val_loss:.4f}")
            if t.checkpoint_every and step % t.checkpoint_every == 0 and not is_last:
                save(step)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        path = save(step) if step > 0 else None
        print(f"\ninterrupted at step {step}; checkpoint: {path}", file=sys.stderr)
        raise
    finally:
        metrics.close()
    if bar is not None:
        bar.close()

    ckpt = save(t.steps)
    text = ""
    if t.sample_tokens > 0:
        text = generate_text(model, tokenizer, t.sample_prompt, t.sample_tokens, t.seq_len, device, t.seed)
        print(f"\n--- sample ---\n{text}\n--------------")
    elapsed = time.perf_counter() - start
    val_msg = f", val loss {val_loss:.4f}" if val_loss is not None else ""
    print(f"done: {t.steps} steps in {elapsed:.0f}s, loss {first_loss:.4f} -> {last_loss:.4f}{val_msg}")
    print(f"checkpoint: {ckpt}\nmetrics: {run_dir / 'metrics.csv'}")
    return TrainResult(run_dir, first_loss, last_loss, val_loss, ckpt, text)


def generate_text(model, tokenizer, prompt: str, n_tokens: int, context: int, device, seed: int) -> str:
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    prompt_ids = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    gen = torch.Generator(device=device).manual_seed(seed)
    out = sample(model, prompt_ids, n_tokens, context=context, generator=gen)
    return tokenizer.decode(out[0].tolist())
