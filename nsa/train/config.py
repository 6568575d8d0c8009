"""Training configuration."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ..errors import ConfigError, UserError


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and output of one training run."""

    steps: int = 500
    """Optimizer steps to run."""
    stop_after: int = 0
    """End this launch after this many steps, with a checkpoint (for time-sliced jobs; the schedule still spans
    train.steps and the next launch resumes); 0 runs to train.steps."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (tokens per step = batch_size * grad_accum * seq_len)."""
    lr: float = 2e-3
    """Peak learning rate of AdamW. The default suits the tiny model; too high a rate closes NSA's gates (all three
    branches of a layer near 0, switching its attention off), which the gate-collapse warning reports. Larger
    models want less (configs/m7c.yaml: 2e-4)."""
    schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    """Learning-rate schedule after the warmup, a function of the step alone (so a resumed run continues it
    exactly): 'cosine' follows a half cosine from lr to lr * min_lr_ratio at train.steps; 'linear' falls in a
    straight line to the same floor; 'wsd' (warmup-stable-decay) holds lr, then over the last
    train.decay_fraction of the steps falls to the floor along 1 - sqrt(progress) (the 1-sqrt cooldown). A
    changed schedule on resume is applied from the resumed step: resuming a constant 'wsd' run with a larger
    train.steps extends it, and its decay then spans the last train.decay_fraction of the new length."""
    decay_fraction: float = 0.2
    """train.schedule=wsd: the share of train.steps, at the end, over which the rate decays to the floor
    (in (0, 1]; the decay starts after the warmup)."""
    min_lr_ratio: float = 0.1
    """Every schedule ends at lr * min_lr_ratio at train.steps."""
    warmup_steps: int = 40
    """Steps of linear warmup from 0 to lr before the schedule's decay (or, under 'wsd', its stable phase)."""
    weight_decay: float = 0.01
    """AdamW weight decay, applied to matrices and embeddings only (not norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW beta1, beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 100
    """Run validation every this many steps (and at the end); 0 disables."""
    eval_batches: int = 8
    """Micro-batches of held-out windows per validation."""
    log_every: int = 10
    """Write a metrics row every this many steps."""
    seed: int = 1337
    """Seed for initialisation and data order."""
    deterministic: bool = False
    """Bit-for-bit reproducible steps on the GPU: two runs of one seed, and a run stopped and resumed, give the
    same losses to the last bit. Turns on torch.use_deterministic_algorithms, under which NSA's backward adds its
    partial sums in a fixed order instead of with float32 atomics, at a small cost in speed. The CPU path is
    deterministic either way."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' is bf16 autocast on GPU and fp32 on CPU."""
    out_dir: str = "runs"
    """Folder that receives one sub-folder per run."""
    run_name: str = ""
    """Name of this run's folder; empty uses the attention kind and a timestamp. Name a run to resume it."""
    sample_tokens: int = 200
    """Tokens to generate at the end of training as a sample; 0 skips it."""
    sample_prompt: str = "And God said"
    """Prompt of the end-of-run sample."""
    progress: bool = True
    """Show a progress bar (otherwise one line per log step)."""


@dataclass
class ParallelConfig:
    """How training is spread over processes (launch several with `torchrun --nproc_per_node=N -m nsa train`)."""

    mode: Literal["auto", "single", "ddp", "fsdp"] = "auto"
    """'auto' is DDP when several processes were launched, else single; 'fsdp' shards parameters, gradients
    and optimizer state (FSDP2, per block and at the root; bf16 parameters with fp32 reduction under bf16)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (non-reentrant): less memory, about a third more compute."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each block and the loss (whose float32 logits are then never written out). 'auto' compiles on
    a GPU (the first step then takes a minute or two) and not on a CPU, where compiling costs more than it saves."""
    cudagraphs: bool | Literal["auto"] = "auto"
    """With compile on a GPU: replay each compiled block's forward and backward, and the loss, as CUDA graphs
    (Inductor's CUDA graph trees, as torch.compile's 'reduce-overhead'), so the host no longer launches their
    kernels one by one. It pays where the host sets the pace (few tokens per GPU per step, small models). Each
    new batch shape records its own graphs, so keep it fixed. Single process and DDP; 'auto' turns it on
    wherever it can run (compiled, on a GPU, not under FSDP2)."""
    allow_single_process: bool = False
    """Allow one process on a machine with several visible GPUs (otherwise an error naming the torchrun command)."""
    timeout_s: float = 600.0
    """Collective timeout: a rank waiting longer than this fails the job instead of hanging it."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward (less memory, one more all-gather)."""
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2: type the gradients are reduce-scattered in. 'bfloat16' sends half the bytes, which pays where the
    per-block reductions show in the step (small batches per GPU); the sums are then rounded to bf16."""

    def resolved(self, mode: str, device_type: str) -> ParallelConfig:
        """This config with 'auto' compile and cudagraphs decided for a run in `mode` ('single', 'ddp' or 'fsdp')
        on a `device_type` device; explicit settings are kept (and checked where they are used)."""
        on_gpu = device_type == "cuda"
        compile_ = on_gpu if self.compile == "auto" else self.compile
        graphs = (compile_ and on_gpu and mode != "fsdp") if self.cudagraphs == "auto" else self.cudagraphs
        return replace(self, compile=compile_, cudagraphs=graphs)

    def check_cudagraphs(self, mode: str, device_type: str | None = None) -> None:
        """Refuse CUDA-graph settings that cannot run, for `mode` (a launch mode or the resolved one) and, once
        known, the device type. Graphs replay compiled code on a GPU, and not under FSDP2, whose blocks gather
        their parameters outside the compiled code, so a replay could not hold a step. The device speaks first:
        on a CPU 'auto' leaves compile off, and 'add parallel.compile=true' would not help."""
        if self.cudagraphs is not True:  # 'auto' never asks for what cannot run
            return
        if device_type is not None and device_type != "cuda":
            raise UserError(f"parallel.cudagraphs=true needs a CUDA device, not {device_type}: drop it or train on "
                            "a GPU")
        if self.compile is False:
            raise ConfigError("parallel.cudagraphs=true replays compiled blocks: add parallel.compile=true")
        if mode == "fsdp":
            raise ConfigError("parallel.cudagraphs=true is for single-process and DDP runs: drop it under "
                              "parallel.mode=fsdp")


@dataclass
class CheckpointConfig:
    """Checkpoints (torch.distributed.checkpoint), resume and retention."""

    every: int = 0
    """Save every this many steps; 0 saves only at the end (a halt or Ctrl-C also saves)."""
    keep: int = 3
    """Complete checkpoints kept per run (older ones are deleted); 0 keeps all."""
    resume: str = "auto"
    """'auto' continues from the latest checkpoint in this run's folder (train.out_dir/train.run_name) if there
    is one; 'none' starts fresh; or the path of a checkpoint or run folder to start from."""
