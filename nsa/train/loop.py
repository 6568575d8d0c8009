"""Training on one process or several (DDP / FSDP2): one loop for every mode.

Rules that keep multi-process runs from hanging: every rank takes the same path through
every collective (setup errors are agreed on before anyone proceeds; logging steps, evaluation
and checkpoints happen on all ranks at the same steps); the host syncs with the GPU only on
logging steps; a non-finite loss or gradient norm on any rank, a HALT file or a stop signal is
agreed on by all ranks a fixed number of steps later (nsa.train.stop) and stops them all at the
same step with a checkpoint and a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from ..config import RunConfig
from ..data.loader import Batch, Data, build_data, split_batch
from ..data.tokenizers import Tokenizer, get_tokenizer, padded_vocab_size
from ..errors import Interrupted, UserError
from ..inference.generate import generate_text
from ..model import Transformer
from ..model.attention import check_dense_backend
from ..telemetry import health
from ..telemetry.gate_watch import GateWatch
from ..telemetry.run_log import RunLog
from ..telemetry.wandb_run import require_wandb
from ..telemetry.watchdog import Watchdog
from ..storage import write_error
from ..typed_config import to_dict
from . import checkpoint
from .config import ParallelConfig
from .distributed import DistInfo, all_reduce_mean, any_rank, check_same_config, init_distributed, shutdown
from .init_from import load_initial_weights
from .optim import apply_hyperparameters, build_optimizer, build_scheduler
from .parallel import apply_parallelism, gradient_sync, resolve_mode, uncompiled, unwrap
from .resume_rules import config_changes, describe, split_changes, with_added_keys
from .run_folder import RunFolder, claim_run_folder, discard_unused
from .signals import StopSignals, exit_code
from .stop import StopDecision, StopRequests
from .tf32 import tf32_matmuls


def peak_memory_gb(device: torch.device, cudagraphs: bool) -> float:
    """Peak GPU memory since the previous call, in GiB: allocated, or under parallel.cudagraphs reserved. A replay
    draws on its graph's private memory pool, which the allocated count does not see, so with graphs on it would
    report a small fraction of what the step holds."""
    peak = torch.cuda.max_memory_reserved(device) if cudagraphs else torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak / 2**30


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


SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 50
"""How the end-of-run sample draws its tokens (train.sample_tokens of them, seeded by train.seed)."""

STEP_KINDS = {"eager": "eager", "compiled": "compiled", "graphs": "compiled, replayed as CUDA graphs"}


def step_kind(parallel: ParallelConfig) -> str:
    """How a resolved config runs each step: 'eager', 'compiled' or 'graphs' (compiled and replayed)."""
    if not parallel.compile:
        return "eager"
    return "graphs" if parallel.cudagraphs else "compiled"


def fsdp_pace_note(mode: str, device_type: str) -> str | None:
    """The banner's note for FSDP2 on a GPU, whose steps replay no CUDA graphs (ParallelConfig.check_cudagraphs):
    where the host sets the pace, a model that fits one GPU trains faster under DDP with graphs than sharded."""
    if mode != "fsdp" or device_type != "cuda":
        return None
    return ("note: FSDP2 replays no CUDA graphs, so with few sequences per GPU the host sets the pace; a model that "
            "fits on one GPU trains faster under DDP (parallel.mode=ddp), which replays them")


def open_run_folder(cfg: RunConfig, info: DistInfo) -> RunFolder:
    """The run folder, claimed by rank 0 (named, created and locked for this launch) and shared with the others;
    if rank 0 cannot claim it, every rank stops with its message."""
    default = f"{cfg.model.attention}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = _agreed_across_ranks(info, lambda: claim_run_folder(Path(cfg.train.out_dir), cfg.train.run_name, default)
                     if info.is_main else None)
    if info.distributed:
        shared = [str(folder.path) if folder else None]
        dist.broadcast_object_list(shared, src=0)
        if folder is None:
            folder = RunFolder(Path(shared[0]), created=False)
    folder.path.mkdir(parents=True, exist_ok=True)  # every rank writes its own files here (one host or several)
    return folder


def _agreed_across_ranks(info: DistInfo, build):
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


def use_deterministic_algorithms(on: bool) -> None:
    """train.deterministic: PyTorch's deterministic mode, which NSA's kernels follow too (nsa.ops.triton.common)."""
    if on:
        # cuBLAS gives the same bits run to run only with a fixed workspace configuration, which it reads from the
        # environment when a handle is created (and PyTorch's deterministic mode refuses matmuls without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo, run_dir: Path):
        self.info = info
        t = cfg.train
        self.mode = resolve_mode(cfg.parallel, info)
        # What 'auto' became here; self.cfg (and the run's config.yaml) keep what was asked for, so a GPU run's
        # config still trains on a CPU.
        self.parallel = cfg.parallel.resolved(self.mode, info.device.type)
        self.bf16 = t.precision == "bf16" or (t.precision == "auto" and info.device.type == "cuda")
        use_deterministic_algorithms(t.deterministic)
        torch.manual_seed(t.seed)  # the same initial weights on every rank
        self.tokenizer = _agreed_across_ranks(info, lambda: get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path))
        if cfg.telemetry.wandb:  # before any work; only rank 0 logs, so only it needs the package
            _agreed_across_ranks(info, lambda: require_wandb() if info.is_main else None)
        self.cfg = cfg = resolve_vocab(cfg, self.tokenizer)
        check_same_config(to_dict(cfg), info)
        self.data: Data = _agreed_across_ranks(info, lambda: build_data(
            cfg.data, self.tokenizer, t.seq_len, t.batch_size, t.eval_batches, t.seed, info.rank, info.world_size))
        self.data.train.pin_for(info.device)
        check_dense_backend(cfg.model, info.device, torch.bfloat16 if self.bf16 else torch.float32)
        model = Transformer(cfg.model)
        if cfg.model.init_from:
            load_initial_weights(cfg.model.init_from, model)
        model = model.to(info.device)
        self.n_params = model.num_parameters()
        self.model = apply_parallelism(model, self.parallel, info, self.mode, self.bf16)
        self.optimizer = build_optimizer(self.model, t, info.device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.run_dir = run_dir
        self.tokens_per_step = t.batch_size * t.grad_accum * t.seq_len * info.world_size
        self.step = 0
        self.tokens = 0
        """Training tokens seen over the whole run (a length curriculum changes the tokens per step)."""
        self.bad_step = torch.full((), -1, dtype=torch.long, device=info.device)
        self.halt_path = self.run_dir / "HALT"
        self.data_wait_s = 0.0
        self.last_batch: torch.Tensor | None = None
        self.step_seq_len: int | None = None
        """Tokens per row of the last step's batches; None when its micro-batches differed (a length drawn per
        micro-batch, data.retrieval.mix_lengths with train.grad_accum > 1)."""
        self.health_step: int | None = None
        self.resume_changes: dict = {}
        self.signals = StopSignals()  # replaced by the active one while the loop runs

    # ------------------------------------------------------------------ checkpoints

    def _rank_state(self) -> dict:
        state = {"step": self.step, "tokens": self.tokens, "scheduler": self.scheduler.state_dict(), "data": self.data.train.state_dict(),
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
        """Load the checkpoint that checkpoint.resume names, if any, after checking that this config may continue
        it (nsa.train.resume_rules); the settings that changed take effect from its step and are remembered in
        self.resume_changes."""
        choice = self.cfg.checkpoint.resume
        if choice == "none" or not choice:
            return None
        path = checkpoint.latest(self.run_dir) if choice == "auto" else checkpoint.resolve(choice)
        if path is None:
            return None
        meta = checkpoint.verify(path)
        fixed, applied = split_changes(config_changes(with_added_keys(meta["config"]), to_dict(self.cfg)))
        if fixed:
            raise UserError(
                f"cannot resume from {path}: it was trained with other settings that shape the model or the data "
                f"stream ({describe(fixed)}); set those back to the checkpoint's values to continue it, or start a "
                "new run (another train.run_name, or checkpoint.resume=none)")
        state = checkpoint.load(path, self.model, self.optimizer, self.info)
        exact = state is not None
        if not exact:
            state = checkpoint.load_rank_state(path, 0)
            self._print(f"warning: {path} was written by {meta['world_size']} ranks; with "
                        f"{self.info.world_size} the data order continues from rank 0's position only approximately")
            state.pop("rng_cpu", None), state.pop("rng_cuda", None)
        self.step = int(state["step"])
        self.tokens = int(state.get("tokens", self.step * self.tokens_per_step))
        self.scheduler.load_state_dict(state["scheduler"])
        self._load_data_position(state["data"], path, exact)
        if "rng_cpu" in state:
            torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.info.device)
        if applied:
            apply_hyperparameters(self.optimizer, self.scheduler, self.cfg.train)
            self.resume_changes = applied
        return path

    def _load_data_position(self, position: dict, path: Path, exact: bool) -> None:
        try:
            self.data.train.load_state_dict(position)
        except (KeyError, TypeError, ValueError) as e:
            if exact:  # the same data config wrote it: a position that does not load is a damaged file
                raise UserError(f"checkpoint {path} holds a data position this data source cannot continue from "
                                f"({e}); resume from an earlier checkpoint, or start over with "
                                "checkpoint.resume=none") from None
            self._print("warning: the data position could not be carried over to this number of ranks; the data "
                        "order starts from the beginning")

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        return autocast_context(self.cfg.train.precision, self.info.device)

    def _new_graph_step(self) -> None:
        """Under parallel.cudagraphs, tell the graph trees that the outputs of earlier replays are no longer read,
        so their memory may be reused."""
        if self.parallel.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()

    def _on_device(self, batch: Batch, non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor | None]:
        """(x, y, cu_seqlens or None) of a batch, on the training device."""
        x, y, cu_seqlens = split_batch(batch)
        device = self.info.device
        return (x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking),
                None if cu_seqlens is None else cu_seqlens.to(device, non_blocking=non_blocking))

    def _loss(self, x: torch.Tensor, y: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """The model's loss; without document boundaries called as (x, y) alone, as before they existed."""
        return self.model(x, y) if cu_seqlens is None else self.model(x, y, cu_seqlens)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; (loss, grad norm) stay on the device."""
        t = self.cfg.train
        self._new_graph_step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.info.device)
        lengths = set()
        for micro in range(t.grad_accum):
            waited = time.perf_counter()
            batch = self.data.train.next_batch()
            self.data_wait_s += time.perf_counter() - waited
            x, y, cu_seqlens = self._on_device(batch, non_blocking=True)
            lengths.add(x.shape[1])  # shape metadata: no wait for the device
            with gradient_sync(self.model, self.mode, micro == t.grad_accum - 1):
                with self._autocast():
                    loss = self._loss(x, y, cu_seqlens) / t.grad_accum
                loss.backward()
            total += loss.detach()
        self.last_batch = x
        self.step_seq_len = lengths.pop() if len(lengths) == 1 else None
        clip = t.grad_clip if t.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.tokens += self.tokens_per_step
        finite = torch.isfinite(total) & torch.isfinite(norm)
        self.bad_step = torch.where(~finite & (self.bad_step < 0), self.step, self.bad_step)
        return total, norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.data.val:
            return None
        self.model.eval()
        losses = []
        for batch in self.data.val:
            self._new_graph_step()
            x, y, cu_seqlens = self._on_device(batch)
            with self._autocast():
                # A copy: under parallel.cudagraphs the next batch's replay overwrites the graph's output.
                losses.append(self._loss(x, y, cu_seqlens).float().clone())
        self.model.train()
        return all_reduce_mean(torch.stack(losses).mean(), self.info).item()

    def health_record(self, is_last: bool) -> dict | None:
        """NSA health statistics of the last batch's first sequence, summed over ranks, when due (every rank
        calls this on every logging step)."""
        every = self.cfg.telemetry.health_every
        if every <= 0 or self.last_batch is None:
            return None
        if not (self.health_step is None or is_last or self.step // every > self.health_step // every):
            return None
        self.health_step = self.step
        # One sequence, unpacked: under document masking the probe reads the slice as a single document.
        tokens = self.last_batch[:1, : self.cfg.telemetry.health_tokens]
        with self._autocast():
            sums = health.probe(self.model, tokens)
        if sums is None:
            return None
        if self.info.distributed:
            for value in sums.values():
                dist.all_reduce(value, op=dist.ReduceOp.SUM)
        if not self.info.is_main:
            return None
        return health.summarize(sums, health.distance_edges(self.cfg.model.nsa.sel_block, tokens.shape[1]))

    # ------------------------------------------------------------------ stopping

    def _halt_non_finite(self, bad_step: int) -> None:
        last_good = checkpoint.latest(self.run_dir)
        halted = self.save(self.run_dir / "checkpoints" / f"halt_{self.step:08d}")
        self.log.event("halt", self.step, reason="non-finite", bad_step=bad_step, path=str(halted))
        raise UserError(
            f"the loss or gradient norm became non-finite at step {bad_step}; stopped at step {self.step} with a "
            f"checkpoint for inspection at {halted}; the last good checkpoint is {last_good} (resume continues "
            "from it); lower train.lr or check the data"
        )

    def _halt_requested(self) -> Path:
        path = self.save()
        self.log.event("halt", self.step, reason="HALT file", path=str(path))
        if self.info.is_main:
            self.halt_path.unlink(missing_ok=True)  # so that the resumed run does not stop at once
        self._print(f"stopped at step {self.step} because {self.halt_path} appeared (now removed); checkpoint: "
                    f"{path}; run the same command again to continue")
        return path

    def _stop_on_signal(self, signum: int) -> None:
        """Every rank, at the agreed step: save this step's state and end the launch with 128 + signum."""
        path = self.save()
        name = signal.Signals(signum).name
        self.log.event("halt", self.step, reason=name, path=str(path))
        raise Interrupted(f"stopped at step {self.step} on {name}; checkpoint: {path}; run the same command again "
                          "to continue", exit_code(signum), show=self.info.is_main)

    def _check_stop(self, decision: StopDecision | None) -> bool:
        """Act on an agreed stop request: raise on non-finite numbers; True when a HALT file or a signal asks to
        stop."""
        if decision is None or not decision.stop:
            return False
        self.stops.settle()  # every rank queued the same later requests; none may outlive the process group
        if decision.bad_step >= 0:
            self._halt_non_finite(decision.bad_step)
        return True

    # ------------------------------------------------------------------ the run

    def _print(self, message: str, bar: tqdm | None = None) -> None:
        if self.info.is_main:
            (bar.write if bar is not None else print)(message)

    def _open_log(self, resumed: Path | None) -> None:
        info, tel = self.info, self.cfg.telemetry
        try:
            wandb = (dict(project=tel.wandb_project, name=tel.wandb_run_name, mode=tel.wandb_mode)
                     if tel.wandb else None)
            self.log = _agreed_across_ranks(info, lambda: RunLog(
                self.run_dir, info.rank, info.is_main, to_dict(self.cfg), info.world_size, self.step, tel.tensorboard,
                wandb))
            self.watchdog = Watchdog(self.run_dir, info.rank, tel.stall_timeout_s, self.log.heartbeat)
        except OSError as e:
            raise write_error(e, e.filename or self.run_dir, "choose a writable train.out_dir") from None
        self.log.event("boot", self.step, local_rank=info.local_rank, world_size=info.world_size,
                       device=str(info.device), pid=os.getpid(), mode=self.mode)
        if resumed:
            changed = {key: [old, new] for key, (old, new) in self.resume_changes.items()}
            self.log.event("resume", self.step, path=str(resumed), changed=changed or None)
        self.watchdog.install_signal_handler()
        self.stops = StopRequests(self.halt_path, info)
        self.gate_watch = GateWatch(tel.gate_collapse, tel.gate_flat_steps)

    def _record_config(self) -> None:
        """config.yaml: the settings this launch trains with (after a resume, with the changes it applied)."""
        if not self.info.is_main:
            return
        path = self.run_dir / "config.yaml"
        try:
            tmp = path.with_name(".config.yaml.tmp")
            tmp.write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            raise write_error(e, path, "choose a writable train.out_dir") from None

    def _check_run_files(self) -> None:
        """Every rank, on logging steps: stop all ranks if some rank's run files could not be written."""
        failure = self.log.failure
        if not any_rank(failure is not None, self.info):
            return
        last = checkpoint.latest(self.run_dir)
        fix = (f"the latest complete checkpoint, {last}, is intact: fix this, then run the same command to resume "
               "from it" if last else "no checkpoint was written yet")
        if failure is None:
            raise UserError(f"another rank could not write its run files; {fix}")
        raise write_error(failure[1], failure[0], fix)

    def _log_step(self, step: int, loss: torch.Tensor, norm: torch.Tensor, window: tuple[float, int], start: float,
                  bar: tqdm, evaluate: bool, is_last: bool) -> dict:
        """Metrics, health and heartbeat of a logging step (all ranks: it holds collectives); the metrics row."""
        info = self.info
        loss_value = all_reduce_mean(loss, info).item()
        now = time.perf_counter()
        seconds = max(now - window[0], 1e-9)
        tok_s = (step - window[1]) * self.tokens_per_step / seconds
        mem_gb = peak_memory_gb(info.device, self.parallel.cudagraphs) if info.device.type == "cuda" else None
        data_wait, self.data_wait_s = min(1.0, self.data_wait_s / seconds), 0.0
        row = {"step": step, "tokens": self.tokens, "loss": loss_value, "val_loss": None,
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm.item(), "tokens_per_s": tok_s,
               "elapsed_s": now - start, "mem_gb": mem_gb, "data_wait": data_wait, "seq_len": self.step_seq_len}
        if evaluate:
            row["val_loss"] = self._evaluate_and_log(step, bar)
        record = self.health_record(is_last)
        if record is not None:
            self.log.health(step, record)
            for warning in self.gate_watch.check(step, record):
                self.log.event("warning", step, message=warning)
                self._print(f"warning: step {step}: {warning}", bar)
        self.log.step(row, {"tokens_per_s": tok_s, "mem_gb": mem_gb, "data_wait": data_wait})
        self._check_run_files()
        if self.cfg.train.progress:
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tok_s:,.0f}")
        else:
            self._print(f"step {step}/{self.cfg.train.steps} loss {loss_value:.4f} tok/s {tok_s:,.0f}")
        return row

    def run(self) -> TrainResult:
        cfg, t, info = self.cfg, self.cfg.train, self.info
        resumed = self.resume()
        self._record_config()
        self._banner(resumed)
        self._open_log(resumed)
        bar = tqdm(total=t.steps, initial=self.step, desc="train", dynamic_ncols=True, file=sys.stdout,
                   disable=not (t.progress and info.is_main))
        result = TrainResult(self.run_dir, None, None, None, None, "")
        start = time.perf_counter()
        window = (start, self.step)  # (time, step) of the previous logging step
        first_step = self.step
        end = min(t.steps, self.step + t.stop_after) if t.stop_after else t.steps
        halted = None
        try:
            with StopSignals(on_first=self._signal_received) as self.signals:
                while self.step < end:
                    loss, norm = self.train_step()
                    self.watchdog.progress(self.step)
                    bar.update(1)
                    step, is_last = self.step, self.step == end
                    save = bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0 and not is_last
                    self.stops.submit(step, self.bad_step, self.signals.received)
                    # Before a checkpoint every pending request is settled, so a checkpoint never holds NaNs.
                    decision = self.stops.decision(step, final=is_last or save)
                    stop = self._check_stop(decision)
                    do_eval = t.eval_every > 0 and (step % t.eval_every == 0 or is_last)
                    if step == 1 or step % t.log_every == 0 or do_eval or is_last or stop:
                        # Host syncs happen only here, on logging steps, identically on every rank.
                        row = self._log_step(step, loss, norm, window, start, bar, evaluate=do_eval and not stop,
                                             is_last=is_last or stop)
                        window = (time.perf_counter(), step)
                        _record_logged_row(result, row)
                    if stop:
                        bar.close()
                        if decision.signal:
                            self._stop_on_signal(decision.signal)
                        halted = self._halt_requested()
                        break
                    if save:
                        self.log.event("checkpoint", step, path=str(self.save()))
                bar.close()
                return self._finish(result, resumed, halted, first_step, start)
        finally:
            bar.close()
            self.data.train.close()
            self.watchdog.close()
            self.log.close()

    def _signal_received(self, signum: int) -> None:
        """On the signal listener's thread: record the request (the stop itself waits for an agreed step)."""
        self.log.event("signal", self.watchdog.step, signal=signal.Signals(signum).name)

    def _banner(self, resumed: Path | None) -> None:
        cfg, info = self.cfg, self.info
        self._print(
            f"nsa train: {cfg.model.attention} model, {self.n_params / 1e6:.2f}M parameters, {cfg.model.n_layers} "
            f"layers, dim {cfg.model.dim}, {cfg.model.n_heads}/{cfg.model.n_kv_heads} heads; {self.mode} on "
            f"{info.world_size} process(es), {info.device.type}, {STEP_KINDS[step_kind(self.parallel)]}"
        )
        self._print(f"data: {self.data.description}; {self.tokens_per_step:,} tokens per step")
        self._print(f"run dir: {self.run_dir}" + (f" (resumed from {resumed})" if resumed else ""))
        if self.resume_changes:
            self._print(f"resumed with changed settings (applied from step {self.step}): "
                        f"{describe(self.resume_changes)}")
        if self.parallel.compile:  # otherwise a silent minute before the first step looks like a hang
            what = "compile the blocks and record their CUDA graphs" if self.parallel.cudagraphs else "compile the blocks"
            self._print(f"the first steps {what}: a minute or two on M7C")
        if note := fsdp_pace_note(self.mode, info.device.type):
            self._print(note)

    def _sample(self) -> str:
        """The end-of-run sample, streamed by rank 0: the prompt and its continuation. Every rank generates it
        (under FSDP2 each forward is a collective), by full forwards over the last train.seq_len tokens, which
        run whatever wraps the model."""
        t = self.cfg.train
        model = unwrap(self.model) if self.mode != "fsdp" else self.model
        self._print("\n--- sample ---")
        with uncompiled(model):
            continuation = generate_text(
                model, self.tokenizer, t.sample_prompt, t.sample_tokens, context=t.seq_len,
                temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, seed=t.seed, cached=False,
                write=None if self.info.is_main else _discard)  # None: stdout
        self._print("--------------")
        return t.sample_prompt + continuation

    def _evaluate_and_log(self, step: int, bar: tqdm) -> float | None:
        val_loss = self.evaluate()
        if val_loss is not None:
            self.log.evaluation(step, val_loss)
            self._print(f"step {step}: val loss {val_loss:.4f}", bar)
        return val_loss

    def _finish(self, result: TrainResult, resumed: Path | None, halted: Path | None, first_step: int,
                start: float) -> TrainResult:
        t = self.cfg.train
        ran = first_step < self.step or resumed is None
        result.checkpoint = halted or (self.save() if ran else resumed)
        if halted is None and t.sample_tokens > 0 and not self.signals.received:
            result.sample = self._sample()
        val_msg = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        if result.first_loss is not None:
            self._print(f"done: step {self.step} in {time.perf_counter() - start:.0f}s, loss {result.first_loss:.4f} "
                        f"-> {result.last_loss:.4f}{val_msg}")
        self.log.event("done", self.step, path=str(result.checkpoint), halted=halted is not None)
        self._print(f"checkpoint: {result.checkpoint}\nmetrics: {self.run_dir / 'metrics.csv'}\n"
                    f"plots and a summary: nsa report {self.run_dir}")
        return result


def _discard(text: str) -> None:
    pass


def _record_logged_row(result: TrainResult, row: dict) -> None:
    result.losses[row["step"]] = result.last_loss = row["loss"]
    result.first_loss = row["loss"] if result.first_loss is None else result.first_loss
    result.val_loss = row["val_loss"] if row["val_loss"] is not None else result.val_loss


def train(cfg: RunConfig) -> TrainResult:
    """Train as configured: single process, or one process per GPU under torchrun (DDP or FSDP2)."""
    info = init_distributed(cfg.train.device, cfg.parallel.timeout_s, cfg.parallel.allow_single_process)
    finished = False
    folder = trainer = None
    try:
        folder = open_run_folder(cfg, info)
        if folder.note and info.is_main:
            print(folder.note)
        with tf32_matmuls(info.device):
            trainer = Trainer(cfg, info, folder.path)
            result = trainer.run()
        finished = True
        return result
    except BaseException:
        # A run that ends before its first step leaves nothing worth keeping: no folder of empty files.
        if folder is not None and folder.created and info.is_main and (trainer is None or trainer.step == 0):
            discard_unused(folder.path)
        raise
    finally:
        if folder is not None:
            folder.release()
        shutdown(info, finished)

