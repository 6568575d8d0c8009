"""`nsa eval`: a checkpoint's validation loss and perplexity, and its retrieval accuracy over a grid of
context lengths and needle depths, into eval.csv, eval.json and one heatmap per task."""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..data.retrieval import TASKS, ExampleTooShort, RetrievalTasks, example_rng
from ..errors import UserError
from ..plots.retrieval import plot_grids
from .ablation import ablated_attention, check_layers
from .grid import Grid, length_label
from .intervals import pooled_accuracy, pooled_first_token, wilson_interval
from .layer_sweep import sweep, sweep_table, write_sweep
from .scoring import ValidationLoss, answer_hits, validation_loss
from .selection import needle_selected, nsa_layers, record_selection

CSV_FIELDS = ["task", "length", "depth", "samples", "correct", "accuracy", "ci_low", "ci_high", "first_token",
              "needle_selected"]
"""eval.csv's columns; ci_low and ci_high bound the accuracy's 95% Wilson interval over the cell's samples."""


@dataclass
class EvalOptions:
    """What `nsa eval` measures and where it writes."""

    lengths: list[int]
    depths: list[float]
    tasks: list[str]
    samples: int = 32
    """Examples per (task, length, depth) cell (each cell's accuracy comes with a 95% interval over them)."""
    val_batches: int = 8
    """Validation batches (of the run's train.batch_size x train.seq_len); 0 skips the validation loss."""
    batch_tokens: int = 65536
    """Tokens per retrieval forward: max(1, batch_tokens // length) examples at a time."""
    seed: int = 0
    """Seed of the retrieval examples (their coordinates in the grid are mixed in)."""
    device: str = "auto"
    out: Path | None = None
    """Output folder; None is <run folder>/eval (eval-ablate-2-3 with layers 2 and 3 ablated)."""
    data_overrides: list[str] = field(default_factory=list)
    """data.key=value overrides of the run's data section (for the validation loss and the kv task)."""
    progress: bool = True
    ablate_attention: list[int] = field(default_factory=list)
    """Layers (0-based) whose attention outputs zeros throughout (their MLPs stay): what the task owes them."""
    ablate_each_layer: bool = False
    """Retrieval only, once with every layer in place and once per layer with its attention removed, into one table
    (ablation.csv, ablation_<task>.png in eval-ablate-each/): which layers the task rests on."""


@dataclass
class EvalResult:
    out_dir: Path
    validation: ValidationLoss | None
    rows: list[dict]
    """eval.csv's rows."""
    skipped: list[dict]
    """{task, length, reason} of every (task, length) not measured."""
    images: list[Path]


# ------------------------------------------------------------------------------------------ arguments


def parse_lengths(text: str) -> list[int]:
    """'4096,8192' -> [4096, 8192] (sorted, duplicates dropped); a UserError names the bad entry."""
    values = []
    for part in _comma_separated(text, "--lengths"):
        try:
            value = int(part)
        except ValueError:
            raise UserError(f"--lengths: '{part}' is not an integer (e.g. --lengths 4096,8192)") from None
        if value < 2:
            raise UserError(f"--lengths: {value} is too short; give context lengths in tokens, e.g. 4096")
        values.append(value)
    return sorted(set(values))


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0] (sorted, duplicates dropped); each in [0, 1]."""
    values = []
    for part in _comma_separated(text, "--depths"):
        try:
            value = float(part)
        except ValueError:
            raise UserError(f"--depths: '{part}' is not a number (e.g. --depths 0,0.25,0.5,0.75,1)") from None
        if not 0.0 <= value <= 1.0:
            raise UserError(f"--depths: {part} is outside [0, 1] (0 is the start of the context, 1 the end)")
        values.append(value)
    return sorted(set(values))


def parse_tasks(text: str) -> list[str]:
    """'passkey,kv' -> ['passkey', 'kv'], in the order given; 'none' or '' for none."""
    if text.strip() in ("", "none"):
        return []
    tasks = []
    for part in _comma_separated(text, "--tasks"):
        if part not in TASKS:
            raise UserError(f"--tasks: unknown task '{part}'; choose from {', '.join(TASKS)} (or none)")
        if part not in tasks:
            tasks.append(part)
    return tasks


def _comma_separated(text: str, option: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserError(f"{option} needs a comma-separated list, got '{text}'")
    return parts


# ------------------------------------------------------------------------------------------- the run


def run_dir_of(checkpoint_path: Path) -> Path:
    """The run folder of a checkpoint folder (runs/<name>/checkpoints/step_N -> runs/<name>)."""
    return checkpoint_path.parent.parent if checkpoint_path.parent.name == "checkpoints" else checkpoint_path.parent


def run_eval(checkpoint_or_run: str | Path, opts: EvalOptions) -> EvalResult:
    """Measure, write eval.csv / eval.json / retrieval_<task>.png, print the tables; returns what was written."""
    from ..hf.folder import is_hf_folder, read_hf_run
    from ..inference.generate import load_for_inference
    from ..train import checkpoint

    target = Path(checkpoint_or_run)
    if not target.exists():
        raise UserError(f"'{target}' does not exist: give a run folder (runs/<name>) or a checkpoint folder")
    if opts.samples < 1 or opts.val_batches < 0 or opts.batch_tokens < 1:
        raise UserError("--samples and --batch-tokens must be >= 1, --val-batches >= 0")
    if is_hf_folder(target):  # an exported model: its own folder stands for the run
        path, run_dir = target, target
        _, config, step = read_hf_run(target)
    else:
        path = checkpoint.resolve(target)
        meta = checkpoint.read_meta(path)
        config, step, run_dir = meta["config"], int(meta["step"]), run_dir_of(path)
    cfg = _run_config(config, opts.data_overrides)
    loaded = load_for_inference(path, opts.device)
    model, device = loaded.model, next(loaded.model.parameters()).device
    check_layers(model, opts.ablate_attention)  # before any folder is made
    if opts.ablate_each_layer and opts.ablate_attention:
        raise UserError("--ablate-each-layer removes one layer at a time; leave out --ablate-attention")
    if opts.ablate_each_layer and not opts.tasks:
        raise UserError("--ablate-each-layer measures retrieval; give --tasks (e.g. passkey)")
    out = Path(opts.out) if opts.out is not None else run_dir / _default_out_name(opts)
    out.mkdir(parents=True, exist_ok=True)
    name = run_dir.name
    print(f"nsa eval: {name} step {step}, {cfg.model.attention} model "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, trained at "
          f"{cfg.train.seq_len} tokens) on {_device_name(device)}")
    if opts.ablate_each_layer:
        tasks = RetrievalTasks(loaded.tokenizer, cfg.data.retrieval.kv_pairs)
        return _layer_sweep(model, tasks, opts, device, out, f"{name} step {step}")
    with ablated_attention(model, opts.ablate_attention):
        if opts.ablate_attention:
            print(f"attention removed (outputs zeros) in layer(s) {', '.join(map(str, opts.ablate_attention))}")
        validation = None
        if opts.val_batches > 0:
            validation = _validation(model, cfg, loaded.tokenizer, opts.val_batches, device)
            if validation is None:
                print(f"validation: skipped: {_no_validation_reason(cfg)}")
            else:
                print(f"validation: loss {validation.loss:.4f}, perplexity {validation.perplexity:.3f} "
                      f"({validation.batches} batches, {validation.tokens:,} tokens of {cfg.data.source})")

        tasks = RetrievalTasks(loaded.tokenizer, cfg.data.retrieval.kv_pairs)
        rows, skipped = _retrieval_grid(model, tasks, opts, device)
    title = f"{name} ({cfg.model.attention}, step {step})"
    grids = _grids(rows, skipped, opts, title)
    selection = _grids(rows, skipped, opts, f"needle block selected, {title}", key="needle_selected")
    panels = {task: [grid] + ([selection[task]] if task in selection else []) for task, grid in grids.items()}
    summary = _summary(path, cfg, model, device, step, name, validation, opts, rows, skipped)
    images = _write_outputs(out, rows, skipped, panels, summary)
    for task, grid in grids.items():
        print(f"\n{task}: exact-match accuracy of {opts.samples} samples per cell (rows: needle depth, columns: "
              "context length; mean and 95% interval over all samples of a length, and the share whose key's first "
              "token was right)")
        print(_table(grid, _interval_rows(rows, task, opts.lengths)))
        for s in skipped:
            if s["task"] == task:
                print(f"skip at {length_label(s['length'])}: {s['reason']}")
        if task in selection:
            print(f"\n{task}: needle block selected at a query of the question "
                  "(share of layers x kv groups; forced blocks count)")
            print(_table(selection[task]))
            print(f"\n{task}: per layer at the queries of the question, over every depth: the needle block selected "
                  "(share of kv groups) and the gates, compressed / selected / window")
            print(layer_table(summary["retrieval"], task))
    print(f"\nwrote {out / 'eval.csv'}, {out / 'eval.json'}" + "".join(f", {p.name}" for p in images))
    return EvalResult(out, validation, rows, skipped, images)


def _default_out_name(opts: EvalOptions) -> str:
    """eval, eval-ablate-2-3 with layers 2 and 3 ablated, or eval-ablate-each for the sweep over layers: an
    ablation never overwrites the model's own scores."""
    if opts.ablate_each_layer:
        return "eval-ablate-each"
    ablated = opts.ablate_attention
    return "eval-ablate-" + "-".join(map(str, ablated)) if ablated else "eval"


def _layer_sweep(model, tasks: RetrievalTasks, opts: EvalOptions, device: torch.device, out: Path,
                 title: str) -> EvalResult:
    """`nsa eval --ablate-each-layer`: the retrieval grid per removed layer (layer_sweep), written and printed."""
    skipped: list[dict] = []

    def score() -> list[dict]:
        rows, skips = _retrieval_grid(model, tasks, opts, device)
        skipped[:] = skips  # every pass skips the same lengths (too short, or out of memory at that length)
        return rows

    rows = sweep(model, score)
    images = write_sweep(out, rows, opts.lengths, title)
    for task in opts.tasks:
        print(f"\n{task}: exact-match accuracy over every depth (95% interval), {opts.samples} samples per depth, by "
              "the layer whose attention was removed")
        print(sweep_table(rows, task, opts.lengths))
        for s in skipped:
            if s["task"] == task:
                print(f"skip at {length_label(s['length'])}: {s['reason']}")
    print(f"\nwrote {out / 'ablation.csv'}" + "".join(f", {p.name}" for p in images))
    return EvalResult(out, None, rows, skipped, images)


def _run_config(config: dict, overrides: list[str]):
    from ..config import RunConfig
    from ..train.resume_rules import with_added_keys
    from ..typed_config import apply_overrides, from_dict

    for item in overrides:
        if not item.startswith("data."):
            raise UserError(f"'{item}': nsa eval takes overrides of the data section only (data.key=value)")
    cfg = apply_overrides(from_dict(RunConfig, with_added_keys(config)), overrides)
    cfg.validate()
    return cfg


def _validation(model, cfg, tokenizer, n_batches: int, device: torch.device) -> ValidationLoss | None:
    from ..data.loader import build_data

    t = cfg.train
    data = build_data(cfg.data, tokenizer, t.seq_len, t.batch_size, n_batches, t.seed)
    data.train.close()  # only the validation batches are used; its thread never started
    return validation_loss(model, data.val, device)


def _no_validation_reason(cfg) -> str:
    """Why the run's data gave no validation batch, and what to do about it."""
    data, window = cfg.data, cfg.train.seq_len + 1
    if data.val_fraction <= 0:
        return ("the run's data.val_fraction is 0, so its data holds nothing out; evaluate with an override such as "
                "data.val_fraction=0.05, or pass --val-batches 0")
    if data.source == "shards":
        from ..data.shards import load_meta

        val = load_meta(data.path)["splits"].get("val", {})
        documents, tokens = val.get("documents", 0), val.get("tokens", 0)
        if not documents:
            return (f"the shards in '{data.path}' hold no validation documents (nsa prepare held out none); prepare "
                    "them again from at least 2 documents, or pass --val-batches 0")
        return (f"the validation shards in '{data.path}' ({documents:,} documents, {tokens:,} tokens) hold no "
                f"window of train.seq_len+1 = {window} tokens; prepare them again with a larger data.val_fraction, "
                "or pass --val-batches 0")
    return f"the {data.source} source gave no validation window of {window} tokens; pass --val-batches 0"


def _retrieval_grid(model, tasks: RetrievalTasks, opts: EvalOptions, device: torch.device
                    ) -> tuple[list[dict], list[dict]]:
    rows: list[dict] = []
    skipped: list[dict] = []
    total = len(opts.tasks) * len(opts.lengths) * len(opts.depths) * opts.samples
    bar = tqdm(total=total, desc="retrieval", unit=" seq", dynamic_ncols=True, file=sys.stderr,
               disable=not opts.progress or total == 0)
    for length in opts.lengths:
        for task in opts.tasks:
            cell = len(opts.depths) * opts.samples
            try:
                # Seeded by the cell's coordinates, not its place in the lists: the same cell of two
                # evaluations (any --tasks order, any other depths) holds the same examples.
                # length + 1 tokens, of which the model reads `length` (answer_hits): the trainer's layout for
                # train.seq_len = length. (A model trained at a fixed length sees its question end at the same
                # place in every example; NSA's block grid is fixed to positions, so that place is part of what
                # it was trained on.)
                examples = [tasks.example(task, length + 1, depth, example_rng(opts.seed, TASKS.index(task), length,
                                                                           round(depth * 10_000), s))
                            for depth in opts.depths for s in range(opts.samples)]
            except ExampleTooShort as e:
                # The example holds length + 1 tokens (the last one only a target), so it needs a context of one less.
                skipped.append({"task": task, "length": length,
                                "reason": f"too short (a {task} example needs a context of at least {e.needed - 1} "
                                          f"tokens; give --lengths {e.needed - 1} or more)"})
                bar.update(cell)
                continue
            scores = _score(model, examples, opts.batch_tokens // length, device, bar.update)
            if scores.failure is not None:
                skipped.append({"task": task, "length": length, "reason": scores.failure})
                bar.write(f"{task} at {length:,} tokens: skipped: {scores.failure}")
                bar.update(cell - len(scores.exact))
                continue
            for d, depth in enumerate(opts.depths):
                cell = slice(d * opts.samples, (d + 1) * opts.samples)
                cell_hits, by_layer = scores.exact[cell], np.array(scores.selected[cell], dtype=float)  # [samples, L]
                cell_gates = np.array(scores.gates[cell], dtype=float)  # [samples, layers, 3]
                correct = sum(cell_hits)
                low, high = wilson_interval(correct, len(cell_hits))
                rows.append({"task": task, "length": length, "depth": depth, "samples": len(cell_hits),
                             "correct": correct, "accuracy": correct / len(cell_hits), "ci_low": low, "ci_high": high,
                             "first_token": sum(scores.first[cell]) / len(cell_hits),
                             "needle_selected": float(by_layer.mean()) if by_layer.size else None,
                             "needle_selected_by_layer": by_layer.mean(0).tolist() if by_layer.size else None,
                             "question_gates_by_layer": cell_gates.mean(0).tolist() if cell_gates.size else None})
    bar.close()
    order = {t: i for i, t in enumerate(opts.tasks)}
    rows.sort(key=lambda r: (order[r["task"]], r["length"], r["depth"]))
    return rows, skipped


@dataclass
class _Scores:
    """Per example, in order: exact match, the key's first token right (the answer's leading space is not
    counted), and for an NSA model per layer the share of kv groups whose selection at a query of the question
    holds the needle and the gates there (empty lists for a dense model). failure: None, or a one-line reason
    when memory ran out."""
    exact: list[bool] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    selected: list[list[float]] = field(default_factory=list)
    gates: list[list[list[float]]] = field(default_factory=list)
    failure: str | None = None


def _score(model, examples, batch: int, device: torch.device, progress: Callable[[int], object]) -> _Scores:
    """Score the examples in batches of `batch` (_Scores)."""
    batch = max(1, batch)
    scores = _Scores()
    layers = nsa_layers(model)
    sel_block = layers[0].cfg.nsa.sel_block if layers else 0
    try:
        for i in range(0, len(examples), batch):
            chunk = examples[i:i + batch]
            tokens = torch.from_numpy(np.stack([e.tokens for e in chunk])).to(device)
            start = torch.tensor([e.answer_start for e in chunk], device=device)
            length = torch.tensor([e.answer_len for e in chunk], device=device)
            with record_selection(model, _question_queries(chunk, device)) as record:
                hits = answer_hits(model, tokens, start, length)  # [B, longest answer]
            scores.exact += hits.all(-1).tolist()
            key_first = torch.tensor([e.key_offset for e in chunk], device=device)
            scores.first += hits.gather(1, key_first[:, None])[:, 0].tolist()
            if record.blocks:
                needle = torch.tensor([[e.needle_start, e.needle_len] for e in chunk], device=device)
                found = needle_selected(record.blocks, needle[:, 0], needle[:, 1], sel_block)  # [B,L,G]
                scores.selected += found.float().mean(-1).tolist()
                scores.gates += torch.stack(record.gates, 1).tolist()  # [B,L,3]
            else:
                scores.selected += [[] for _ in chunk]
                scores.gates += [[] for _ in chunk]
            progress(len(chunk))
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        scores.failure = f"out of memory at batch {batch} ({str(e).strip().splitlines()[0][:120]})"
    if scores.failure is not None and device.type == "cuda":
        # Only now, with the exception and its frames gone, are the failed batch's tensors free.
        torch.cuda.empty_cache()
    return scores


def _question_queries(examples: list, device: torch.device) -> torch.Tensor:
    """[B,P] the positions of each example's question, up to the query before its answer; shorter questions
    repeat their last position (a repeat changes no 'any')."""
    spans = [range(e.question_start, e.answer_start) for e in examples]
    width = max(len(s) for s in spans)
    return torch.tensor([list(s) + [s[-1]] * (width - len(s)) for s in spans], device=device)


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def _grids(rows: list[dict], skipped: list[dict], opts: EvalOptions, title: str,
           key: str = "accuracy") -> dict[str, Grid]:
    """One grid per task of rows' `key`; tasks without a value of it (a dense model's needle_selected) get none."""
    grids = {}
    for task in opts.tasks:
        acc = np.full((len(opts.depths), len(opts.lengths)), math.nan)
        for r in rows:
            if r["task"] == task and r.get(key) is not None:
                acc[opts.depths.index(r["depth"]), opts.lengths.index(r["length"])] = r[key]
        if key != "accuracy" and not np.isfinite(acc).any():
            continue
        reasons = {s["length"]: s["reason"].split(" (")[0] for s in skipped if s["task"] == task}
        grids[task] = Grid(f"{task}: {title}", list(opts.lengths), list(opts.depths), acc, reasons)
    return grids


# ------------------------------------------------------------------------------------------- outputs


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _summary(path: Path, cfg, model, device: torch.device, step: int, name: str,
             validation: ValidationLoss | None, opts: EvalOptions, rows: list[dict], skipped: list[dict]) -> dict:
    from ..telemetry.environment import git_revision, versions

    mean, interval, first, selected, by_layer, question_gates = {}, {}, {}, {}, {}, {}
    for task in opts.tasks:
        for length in opts.lengths:
            cell = [r for r in rows if r["task"] == task and r["length"] == length]
            if cell:
                pooled = pooled_accuracy(cell)
                mean.setdefault(task, {})[str(length)] = pooled.pop("accuracy")
                interval.setdefault(task, {})[str(length)] = pooled
                first.setdefault(task, {})[str(length)] = pooled_first_token(cell)
            layers = [r["needle_selected_by_layer"] for r in cell if r.get("needle_selected_by_layer") is not None]
            if layers:
                by_layer.setdefault(task, {})[str(length)] = np.mean(layers, axis=0).tolist()
                selected.setdefault(task, {})[str(length)] = float(np.mean(layers))
            layer_gates = [r["question_gates_by_layer"] for r in cell if r.get("question_gates_by_layer") is not None]
            if layer_gates:
                question_gates.setdefault(task, {})[str(length)] = np.mean(layer_gates, axis=0).round(4).tolist()
    return {
        "run": name,
        "checkpoint": str(path),
        "step": step,
        "attention": cfg.model.attention,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_seq_len": cfg.train.seq_len,
        "device": _device_name(device),
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "versions": versions(),
        "git": git_revision(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "data": {"source": cfg.data.source, "tokenizer": cfg.data.tokenizer, "overrides": list(opts.data_overrides)},
        "ablated_attention": list(opts.ablate_attention),
        "validation": None if validation is None else {
            "loss": validation.loss, "perplexity": validation.perplexity, "batches": validation.batches,
            "tokens": validation.tokens, "seq_len": cfg.train.seq_len,
        },
        "retrieval": {
            "tasks": list(opts.tasks), "lengths": list(opts.lengths), "depths": list(opts.depths),
            "samples": opts.samples, "seed": opts.seed, "kv_pairs": cfg.data.retrieval.kv_pairs,
            # per task and length, over the samples of every depth: the accuracy, and its samples, hits and
            # 95% Wilson interval
            "mean_accuracy": mean, "mean_accuracy_interval": interval, "skipped": skipped,
            # per task and length, over the samples of every depth: the share whose key's first token was right
            # (the key was found; an exact miss with a right first token lost the copy after it)
            "first_token": first,
            # NSA only: share of (layer, kv group) whose selection at a query of the question held the needle
            "needle_selected": selected, "needle_selected_by_layer": by_layer,
            # NSA only: [layers][cmp, sel, win] gate means at the queries of the question
            "question_gates_by_layer": question_gates,
        },
    }


def _write_outputs(out: Path, rows: list[dict], skipped: list[dict], grids: dict[str, list[Grid]], summary: dict
           ) -> list[Path]:
    with open(out / "eval.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            sel = r.get("needle_selected")
            writer.writerow({**r, "depth": f"{r['depth']:g}", "accuracy": f"{r['accuracy']:.4f}",
                             "ci_low": f"{r['ci_low']:.4f}", "ci_high": f"{r['ci_high']:.4f}",
                             "first_token": f"{r['first_token']:.4f}",
                             "needle_selected": "" if sel is None else f"{sel:.4f}"})
    (out / "eval.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    images = []
    for task, task_grids in grids.items():
        label = "exact match / share selected" if len(task_grids) > 1 else "exact-match accuracy"
        images.append(plot_grids(task_grids, out / f"retrieval_{task}.png", label=label))
    for old in out.glob("retrieval_*.png"):  # never leave a heatmap of a task this run did not measure
        if old not in images:
            old.unlink()
    return images


def _interval_rows(rows: list[dict], task: str, lengths: list[int]) -> list[dict[str, str]]:
    """The printed table's last rows: per length, the accuracy over all its samples, its 95% interval, the
    number of samples and the share whose key's first token was right."""
    mean, interval, samples = {"depth": "mean"}, {"depth": "95% CI"}, {"depth": "samples"}
    first = {"depth": "1st token"}
    for n in lengths:
        cells = [r for r in rows if r["task"] == task and r["length"] == n]
        label = length_label(n)
        if not cells:
            mean[label] = interval[label] = samples[label] = first[label] = "skip"
            continue
        pooled = pooled_accuracy(cells)
        mean[label] = f"{pooled['accuracy']:.2f}"
        interval[label] = f"{pooled['ci_low']:.2f}-{pooled['ci_high']:.2f}"
        samples[label] = str(pooled["samples"])
        first[label] = f"{pooled_first_token(cells):.2f}"
    return [mean, interval, samples, first]


def layer_table(retrieval: dict, task: str) -> str:
    """Per NSA layer (rows) and length (columns), from eval.json's "retrieval" section: the share of kv groups
    that selected the needle's block at a query of the question, and that layer's gates there (compressed /
    selected / window). Which layer fetches the needle, and through which branch, shows here and not in the
    means over layers."""
    from ..bench.common import format_table

    selected = retrieval["needle_selected_by_layer"].get(task, {})
    gates = retrieval["question_gates_by_layer"].get(task, {})
    lengths = [n for n in selected if n in gates]
    table = []
    for layer in range(len(selected[lengths[0]]) if lengths else 0):
        row = {"layer": str(layer)}
        for n in lengths:
            shares = "/".join(f"{g:.2f}" for g in gates[n][layer])
            row[length_label(int(n))] = f"{selected[n][layer]:.2f}  {shares}"
        table.append(row)
    return format_table(table, ["layer"] + [length_label(int(n)) for n in lengths])


def _table(grid: Grid, footer: list[dict[str, str]] | None = None) -> str:
    """The grid by depth (rows) and length (columns), then `footer`'s rows; without one, the mean of each column."""
    from ..bench.common import format_table

    columns = ["depth"] + [length_label(n) for n in grid.lengths]
    table = []
    for i, depth in enumerate(grid.depths):
        row = {"depth": f"{100 * depth:.0f}%"}
        for j, n in enumerate(grid.lengths):
            value = grid.acc[i, j]
            row[length_label(n)] = f"{value:.2f}" if math.isfinite(value) else "skip"
        table.append(row)
    if footer is None:
        footer = [{"depth": "mean"}]
        for j, n in enumerate(grid.lengths):
            column = grid.acc[:, j]
            footer[0][length_label(n)] = f"{np.nanmean(column):.2f}" if np.isfinite(column).any() else "skip"
    return format_table(table + footer, columns)
