"""Training on one process or several (DDP / FSDP2): one loop for every mode.

Rules that keep multi-process runs from hanging: every rank takes the same path through
every collective (setup errors are agreed on before anyone proceeds; logging steps, evaluation
and checkpoints happen on all ranks at the same steps); the host syncs with the GPU only on
logging steps; a non-finite loss or gradient norm on any rank is noticed by all ranks at the
next logging step and stops them all with a checkpoint and a message.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from ..config import RunConfig
from ..data.loader import Data, build_data
from ..data.tokenizers import Tokenizer, get_tokenizer, padded_vocab_size
from ..errors import UserError
from ..model import Transformer
from ..model.sampling import sample
from ..telemetry.metrics import MetricsCSV
from ..typed_config import to_dict
from . import checkpoint
from .distributed import DistInfo, all_reduce_mean, any_rank, check_same_config, init_distributed, shutdown
from .optim import build_optimizer, build_scheduler
from .parallel import apply_parallelism, gradient_sync, resolve_mode, unwrap

METRIC_FIELDS = ["step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"]


@dataclass
class TrainResult:
    run_dir: Path
    first_loss: float | None
    last_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    sample: str
    losses: dict[int, float] = field(default_factory=dict)
    """Logged training loss (mean over ranks) by step."""


def resolve_vocab(cfg: RunConfig, tokenizer: Tokenizer) -> RunConfig:
    vocab = cfg.model.vocab_size or padded_vocab_size(tokenizer.vocab_size)
    if vocab < tokenizer.vocab_size:
        raise UserError(
            f"model.vocab_size={vocab} is smaller than the '{tokenizer.name}' tokenizer's "
            f"{tokenizer.vocab_size} tokens; set model.vocab_size=0 to size it from the tokenizer"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast on GPU under precision 'auto' or 'bf16'; plain fp32 otherwise."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _run_dir(cfg: RunConfig, info: DistInfo) -> Path:
    """The run folder, named on rank 0 and shared with the others."""
    name = cfg.train.run_name or f"{cfg.model.attention}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not cfg.train.run_name:
        base, suffix = name, 1
        while (Path(cfg.train.out_dir) / name).exists():
            suffix += 1
            name = f"{base}-{suffix}"
    if info.distributed:
        shared = [name]
        dist.broadcast_object_list(shared, src=0)
        name = shared[0]
    run_dir = Path(cfg.train.out_dir) / name
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "config.yaml", "w", encoding="utf-8") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return run_dir


def _agreed(info: DistInfo, build):
    """Run `build` on every rank; if it fails anywhere, every rank raises (nobody waits in a collective)."""
    error = None
    try:
        result = build()
    except (UserError, OSError, RuntimeError, ValueError) as e:
        error, result = e, None
    if any_rank(error is not None, info):
        if error is not None:
            raise error
        raise UserError("another rank failed during setup (see its message above)")
    return result


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo):
        self.info = info
        t = cfg.train
        self.mode = resolve_mode(cfg.parallel, info)
        self.bf16 = t.precision == "bf16" or (t.precision == "auto" and info.device.type == "cuda")
        if info.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(t.seed)  # the same initial weights on every rank
        self.tokenizer = _agreed(info, lambda: get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path))
        self.cfg = cfg = resolve_vocab(cfg, self.tokenizer)
        check_same_config(to_dict(cfg), info)
        self.data: Data = _agreed(info, lambda: build_data(
            cfg.data, self.tokenizer, t.seq_len, t.batch_size, t.eval_batches, t.seed, info.rank, info.world_size))
        model = Transformer(cfg.model).to(info.device)
        self.n_params = model.num_parameters()
        self.model = apply_parallelism(model, cfg.parallel, info, self.mode, self.bf16)
        self.optimizer = build_optimizer(self.model, t, info.device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.run_dir = _run_dir(cfg, info)
        self.tokens_per_step = t.batch_size * t.grad_accum * t.seq_len * info.world_size
        self.step = 0
        self.bad_step = torch.full((), -1, dtype=torch.long, device=info.device)

    # ------------------------------------------------------------------ checkpoints

    def _rank_state(self) -> dict:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "data": self.data.train.state_dict(),
                 "rng_cpu": torch.get_rng_state()}
        if self.info.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.info.device)
        return state

    def save(self, path: Path | None = None) -> Path:
        path = path or checkpoint.checkpoint_dir(self.run_dir, self.step)
        meta = {"step": self.step, "config": to_dict(self.cfg), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        keep = self.cfg.checkpoint.keep if path.name.startswith(checkpoint.PREFIX) else 0
        return checkpoint.save(path, self.model, self.optimizer, self._rank_state(), meta, self.info, keep)

    def resume(self) -> Path | None:
        choice = self.cfg.checkpoint.resume
        if choice == "none" or not choice:
            return None
        path = checkpoint.latest(self.run_dir) if choice == "auto" else checkpoint.resolve(choice)
        if path is None:
            return None
        state = checkpoint.load(path, self.model, self.optimizer, self.info)
        if state is None:
            state = torch.load(path / "rank0.pt", map_location="cpu", weights_only=False)
            self._print(f"warning: {path} was written by {checkpoint.read_meta(path)['world_size']} ranks; with "
                        f"{self.info.world_size} the data order continues from rank 0's position only approximately")
            state.pop("rng_cpu", None), state.pop("rng_cuda", None)
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        with contextlib.suppress(KeyError, TypeError, ValueError):
            self.data.train.load_state_dict(state["data"])
        if "rng_cpu" in state:
            torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.info.device)
        return path

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        return autocast_context(self.cfg.train.precision, self.info.device)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; (loss, grad norm) stay on the device."""
        t = self.cfg.train
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.info.device)
        for micro in range(t.grad_accum):
            x, y = self.data.train.next_batch()
            x, y = x.to(self.info.device, non_blocking=True), y.to(self.info.device, non_blocking=True)
            with gradient_sync(self.model, self.mode, micro == t.grad_accum - 1):
                with self._autocast():
                    loss = self.model(x, y) / t.grad_accum
                loss.backward()
            total += loss.detach()
        clip = t.grad_clip if t.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        finite = torch.isfinite(total) & torch.isfinite(norm)
        self.bad_step = torch.where(~finite & (self.bad_step < 0), self.step, self.bad_step)
        return total, norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.data.val:
            return None
        self.model.eval()
        losses = []
        for x, y in self.data.val:
            with self._autocast():
                losses.append(self.model(x.to(self.info.device), y.to(self.info.device)).float())
        self.model.train()
        return all_reduce_mean(torch.stack(losses).mean(), self.info).item()

    def _halt_if_non_finite(self) -> None:
        bad = self.bad_step.clone()
        if self.info.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() < 0:
            return
        last_good = checkpoint.latest(self.run_dir)
        halted = self.save(self.run_dir / "checkpoints" / f"halt_{self.step:08d}")
        raise UserError(
            f"the loss or gradient norm became non-finite at step {bad.item()}; stopped at step {self.step} with a "
            f"checkpoint for inspection at {halted}; the last good checkpoint is {last_good} (resume continues "
            "from it); lower train.lr or check the data"
        )

    # ------------------------------------------------------------------ the run

    def _print(self, message: str, bar: tqdm | None = None) -> None:
        if self.info.is_main:
            (bar.write if bar is not None else print)(message)

    def _metrics(self) -> MetricsCSV | None:
        if not self.info.is_main:
            return None
        path = self.run_dir / "metrics.csv"
        kept = []
        if self.step > 0 and path.exists():  # resumed: drop rows logged after the checkpoint
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= self.step]
        metrics = MetricsCSV(path, METRIC_FIELDS)
        for row in kept:
            metrics.write(row)
        return metrics

    def run(self) -> TrainResult:
        cfg, t, info = self.cfg, self.cfg.train, self.info
        resumed = self.resume()
        self._print(
            f"nsa train: {cfg.model.attention} model, {self.n_params / 1e6:.2f}M parameters, {cfg.model.n_layers} "
            f"layers, dim {cfg.model.dim}, {cfg.model.n_heads}/{cfg.model.n_kv_heads} heads; {self.mode} on "
            f"{info.world_size} process(es), {info.device.type}"
        )
        self._print(f"data: {self.data.description}; {self.tokens_per_step:,} tokens per step")
        self._print(f"run dir: {self.run_dir}" + (f" (resumed from {resumed})" if resumed else ""))
        metrics = self._metrics()
        bar = tqdm(total=t.steps, initial=self.step, desc="train", dynamic_ncols=True, file=sys.stdout,
                   disable=not (t.progress and info.is_main))
        result = TrainResult(self.run_dir, None, None, None, None, "")
        start = last_time = time.perf_counter()
        last_step = self.step
        end = min(t.steps, self.step + t.stop_after) if t.stop_after else t.steps
        try:
            while self.step < end:
                loss, norm = self.train_step()
                bar.update(1)
                step, is_last = self.step, self.step == end
                do_eval = t.eval_every > 0 and (step % t.eval_every == 0 or is_last)
                if not (step == 1 or step % t.log_every == 0 or do_eval or is_last):
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        self.save()
                    continue
                # Host syncs happen only here, on logging steps, identically on every rank.
                self._halt_if_non_finite()
                loss_value = all_reduce_mean(loss, info).item()
                now = time.perf_counter()
                tok_s = (step - last_step) * self.tokens_per_step / max(now - last_time, 1e-9)
                last_time, last_step = now, step
                val_loss = self.evaluate() if do_eval else None
                result.losses[step] = loss_value
                result.first_loss = loss_value if result.first_loss is None else result.first_loss
                result.last_loss, result.val_loss = loss_value, val_loss if val_loss is not None else result.val_loss
                if metrics:
                    metrics.write({"step": step, "tokens": step * self.tokens_per_step, "loss": loss_value,
                                   "val_loss": val_loss, "lr": self.scheduler.get_last_lr()[0],
                                   "grad_norm": norm.item(), "tokens_per_s": tok_s, "elapsed_s": now - start})
                if t.progress:
                    bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tok_s:,.0f}")
                else:
                    self._print(f"step {step}/{t.steps} loss {loss_value:.4f} tok/s {tok_s:,.0f}")
                if val_loss is not None:
                    self._print(f"step {step}: val loss {val_loss:.4f}", bar)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and not is_last:
                    self.save()
        except KeyboardInterrupt:
            bar.close()
            # One process can save safely; across processes a collective save could wait on a rank that
            # is already gone, so the last periodic checkpoint stands.
            if not info.distributed and self.step > 0:
                path = self.save()
                print(f"\ninterrupted at step {self.step}; checkpoint: {path}", file=sys.stderr)
            raise
        finally:
            bar.close()
            self.data.train.close()
            if metrics:
                metrics.close()
        ran = last_step < self.step or resumed is None
        result.checkpoint = self.save() if ran else resumed
        if t.sample_tokens > 0:
            result.sample = generate_text(unwrap(self.model) if self.mode != "fsdp" else self.model, self.tokenizer,
                                          t.sample_prompt, t.sample_tokens, t.seq_len, info.device, t.seed)
            self._print(f"\n--- sample ---\n{result.sample}\n--------------")
        val_msg = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        if result.first_loss is not None:
            self._print(f"done: step {self.step} in {time.perf_counter() - start:.0f}s, loss {result.first_loss:.4f} "
                        f"-> {result.last_loss:.4f}{val_msg}")
        self._print(f"checkpoint: {result.checkpoint}\nmetrics: {self.run_dir / 'metrics.csv'}")
        return result


def train(cfg: RunConfig) -> TrainResult:
    """Train as configured: single process, or one process per GPU under torchrun (DDP or FSDP2)."""
    info = init_distributed(cfg.train.device, cfg.parallel.timeout_s, cfg.parallel.allow_single_process)
    try:
        return Trainer(cfg, info).run()
    finally:
        shutdown(info)


def generate_text(model, tokenizer, prompt: str, n_tokens: int, context: int, device, seed: int) -> str:
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    prompt_ids = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    gen = torch.Generator(device=device).manual_seed(seed)
    out = sample(model, prompt_ids, n_tokens, context=context, generator=gen)
    return tokenizer.decode(out[0].tolist())

