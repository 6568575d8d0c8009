"""The `nsa` command: `nsa train [CONFIG] [key=value ...]`, `nsa config ...`, `nsa report RUN_DIR`,
`nsa eval CHECKPOINT_OR_RUN`, `nsa compare RUN_DIR ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .console import pipe_safe_output
from .errors import Interrupted, UserError
from .storage import os_error_message

EVAL_LENGTHS = "4096,8192,16384,32768,65536"
EVAL_DEPTHS = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1"
CONFIG_HELP = ("a YAML file (e.g. configs/m7c.yaml) or a preset name from configs/: tiny (the defaults, a small NSA "
               "model for a CPU) or m7c (the 125M-parameter reference model, docs/design.md#m7c)")


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument without '=' is the config file; the rest are key=value overrides."""
    path, overrides = None, []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = arg
        else:
            raise UserError(f"unexpected argument '{arg}': give one config file, then key=value overrides")
    return _find_config(path), overrides


def _bench_config(args: list[str]) -> tuple[str | None, list[str]]:
    """Benchmarks measure M7C unless a config file is named (overrides alone still apply to M7C)."""
    path, overrides = _split_config_args(args)
    return path or _find_config("m7c"), overrides


def _find_config(name: str | None) -> str | None:
    """Accept a path, or a bare preset name looked up in ./configs and the source tree's configs/ (the presets:
    tiny.yaml, the defaults; m7c.yaml, M7C, the 125M-parameter reference model of docs/design.md#m7c)."""
    if name is None or Path(name).exists() or name.endswith((".yaml", ".yml")):
        return name
    for folder in (Path("configs"), Path(__file__).resolve().parent.parent / "configs"):
        candidate = folder / f"{name}.yaml"
        if candidate.exists():
            return str(candidate)
    raise UserError(f"config '{name}' not found: give a YAML path such as configs/{name}.yaml")


def _cmd_train(ns: argparse.Namespace) -> int:
    from .config import load_config
    from .train.loop import train

    path, overrides = _split_config_args(ns.args)
    train(load_config(path, overrides))
    return 0


def _cmd_prepare(ns: argparse.Namespace) -> int:
    from .config import load_config
    from .data.prepare import prepare

    path, overrides = _split_config_args(ns.args)
    cfg = load_config(path, overrides)
    meta = prepare(cfg.data, ns.out, shard_tokens=ns.shard_tokens, max_documents=ns.max_documents)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens in {info['shards']} shard(s)")
    print(f"wrote {ns.out} ({meta['tokenizer']} tokens); train with data.source=shards data.path={ns.out}")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    if ns.format == "hf":
        from .hf.export import export_hf

        print(f"wrote {export_hf(ns.checkpoint, ns.out)} (a Hugging Face model folder)")
        return 0
    from .train.checkpoint import export_safetensors

    print(f"wrote {export_safetensors(ns.checkpoint, ns.out)}")
    return 0


def _cmd_convert(ns: argparse.Namespace) -> int:
    from .convert import convert

    out = convert(ns.dense_dir, ns.out_dir, ns.overrides)
    print(f"wrote {out}; sample with `nsa generate {out}`, continue training with "
          f"`nsa train {out / 'train.yaml'} data.source=text data.path=...` (docs/convert.md)")
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from .inference.generate import generate_text, generate_texts, load_for_inference

    prompts = ns.prompt or [""]
    loaded = load_for_inference(ns.checkpoint, ns.device)
    options = {"context": ns.max_context or loaded.context, "temperature": ns.temperature, "top_p": ns.top_p,
               "top_k": ns.top_k, "seed": ns.seed, "compile": ns.compile}
    if len(prompts) == 1:
        generate_text(loaded.model, loaded.tokenizer, prompts[0], ns.max_new_tokens, **options)
    else:
        texts = generate_texts(loaded.model, loaded.tokenizer, prompts, ns.max_new_tokens, **options)
        print("\n\n".join(prompt + text for prompt, text in zip(prompts, texts)))
    return 0


def _cmd_report(ns: argparse.Namespace) -> int:
    from .telemetry.report import REPORT_IMAGES, render_report

    report = render_report(Path(ns.run_dir), Path(ns.out) if ns.out else None)
    images = [name for name in REPORT_IMAGES if (report.parent / name).exists()]
    print(f"wrote {report}")
    print(f"files in {report.parent}: {', '.join([report.name] + images)}")
    return 0


def _cmd_eval(ns: argparse.Namespace) -> int:
    from .eval.ablation import parse_layers
    from .eval.runner import EvalOptions, parse_depths, parse_lengths, parse_tasks, run_eval

    opts = EvalOptions(
        lengths=parse_lengths(ns.lengths), depths=parse_depths(ns.depths), tasks=parse_tasks(ns.tasks),
        samples=ns.samples, val_batches=ns.val_batches, batch_tokens=ns.batch_tokens, seed=ns.seed,
        device=ns.device, out=Path(ns.out) if ns.out else None, data_overrides=ns.overrides,
        progress=not ns.no_progress, ablate_attention=parse_layers(ns.ablate_attention),
        ablate_each_layer=ns.ablate_each_layer,
    )
    run_eval(ns.checkpoint, opts)
    return 0


def _cmd_compare(ns: argparse.Namespace) -> int:
    from .eval.compare import render_compare

    report = render_compare([Path(d) for d in ns.run_dirs], Path(ns.out))
    print(f"wrote {report}")
    print(f"files in {report.parent}: {', '.join(sorted(p.name for p in report.parent.iterdir() if p.is_file()))}")
    return 0


def _cmd_config(ns: argparse.Namespace) -> int:
    import yaml

    from .config import load_config
    from .train.resume_rules import RULE_DOCS, resume_rule
    from .typed_config import describe_fields, to_dict

    path, overrides = _split_config_args(ns.args)
    cfg = load_config(path, overrides)
    if ns.docs:
        for key, value, doc in describe_fields(cfg):
            print(f"{key} = {value!r}\n    {doc}\n    [{RULE_DOCS[resume_rule(key)]}]")
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _triton_packed(ns: argparse.Namespace) -> None:
    """--triton-packed: packed documents on the Triton kernels only (TUNING.gluon_packed off, this process)."""
    if ns.triton_packed:
        from .ops.tuning import TUNING

        TUNING.gluon_packed = False
        print("packed documents run on the Triton kernels (TUNING.gluon_packed off)")


def _cmd_bench_attention(ns: argparse.Namespace) -> int:
    from .bench import attention

    _triton_packed(ns)

    lengths = ns.lengths if ns.lengths is not None else [] if ns.docs is not None else attention.LENGTHS
    attention.run(
        shapes=ns.shapes.split(","), lengths=lengths, out_dir=ns.out, backward=not ns.forward_only,
        use_fla=not ns.no_fla, breakdown_at=ns.components, sweep_at=ns.sweep, batch=ns.batch,
        sweep_params=[p for p in ns.sweep_params.split(",") if p], graphs=ns.graphs, docs=ns.docs,
    )
    return 0


def _cmd_bench_decode(ns: argparse.Namespace) -> int:
    from .bench import decode

    path, overrides = _bench_config(ns.args)
    decode.run(path, overrides, contexts=ns.contexts, batches=ns.batches, attentions=ns.attention.split(","),
               steps=ns.steps, out_dir=ns.out, device=ns.device, compile=ns.compile, profile=ns.profile)
    return 0


def _cmd_bench_train(ns: argparse.Namespace) -> int:
    from .bench import training

    _triton_packed(ns)

    path, overrides = _bench_config(ns.args)
    training.run(path, overrides, seq_lens=ns.seq_lens, attentions=ns.attention.split(","),
                 batch_tokens=ns.batch_tokens, steps=ns.steps, warmup=ns.warmup, out_dir=ns.out, profile=ns.profile)
    return 0


def _cmd_bench_plot(ns: argparse.Namespace) -> int:
    from .plots.bench import plot_file

    print(f"wrote {plot_file(ns.results, ns.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nsa", description="Native Sparse Attention language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model (no arguments: the tiny NSA model on the embedded corpus)",
        description="Train a model. Settings come from the defaults, then CONFIG, then key=value overrides "
        "(e.g. nsa train configs/m7c.yaml train.steps=100 model.n_layers=2). `nsa config --docs` lists every key.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help=CONFIG_HELP)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "prepare",
        help="tokenize a data source once into token shards (then train with data.source=shards)",
        description="Reads the data section of CONFIG (+ overrides), tokenizes every document and writes "
        "train_*.bin / val_*.bin shards and meta.json into --out.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help=CONFIG_HELP)
    p.add_argument("--out", required=True, help="output folder (must be new or empty)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--max-documents", type=int, default=0, help="stop after this many documents (0: all)")
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("export", help="consolidate a checkpoint's weights into one safetensors file, or write a "
                       "Hugging Face model folder (--format hf)")
    p.add_argument("checkpoint", help="a checkpoint folder or a run folder (its latest checkpoint)")
    p.add_argument("out", help="output .safetensors path (--format safetensors) or folder (--format hf)")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                   help="safetensors: the weights in one file; hf: config.json, model.safetensors, "
                        "generation_config.json and tokenizer files for transformers (a dense model as "
                        "LlamaForCausalLM, docs/interop.md; needs pip install \"nsa[hf]\")")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "convert",
        help="a dense Hugging Face Llama model folder as an NSA checkpoint folder (then generate, eval, train)",
        description="Reads DENSE_HF_DIR (config.json and *.safetensors of a LlamaForCausalLM) and writes OUT_DIR, a "
        "checkpoint folder of the NSA model of the same shape: embeddings, norms, MLP, query and output projections "
        "copied, every branch's keys and values from the dense ones, phi at the block mean, every gate at 1/2; the "
        "tokenizer files alongside, and OUT_DIR/train.yaml to continue training (docs/convert.md).",
    )
    p.add_argument("dense_dir", metavar="DENSE_HF_DIR", help="a Hugging Face model folder saved by save_pretrained")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the checkpoint folder to write (new or empty)")
    p.add_argument("overrides", nargs="*", metavar="model.nsa.key=value",
                   help="NSA hyper-parameters (default M7C's: model.nsa.window=512 ...), e.g. model.nsa.window=4096")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint (cached decoding, streamed to stdout)",
        description="Loads CHECKPOINT's model and tokenizer, prints the prompt and streams the continuation "
        "until end-of-text or --max-new-tokens. Greedy with --temperature 0. Several --prompt are continued "
        "together (one packed prefill, then one decode step for all a token) and printed when done, each prompt "
        "and its continuation, a blank line between them.",
    )
    p.add_argument("checkpoint", help="a checkpoint folder, a run folder (its latest checkpoint) or a folder written "
                   "by nsa export --format hf")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (empty: start from end-of-text); repeat for several")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate at most (default: 200, or as many as fit the context)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep the likeliest tokens up to "
                   "this probability mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto: cuda if present)")
    p.add_argument("--max-context", type=int, default=0, help="tokens the prompt plus the continuation may fill "
                   "(0: the checkpoint's train.seq_len)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step first: its small kernels fuse, so each token is faster, "
                        "after a compilation of about a minute; for long or many generations")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "report",
        help="plots and a markdown summary of a run folder (finished or still running)",
        description="Reads RUN_DIR's metrics.csv (and nsa_stats.jsonl, heartbeat_rank*.jsonl, env.json, config.yaml "
        "when present) and writes loss/throughput/lr/memory/gate/selection PNGs and report.md; for a run of mixed "
        "sequence lengths it also prints the loss per length.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. runs/<name>")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "eval",
        help="validation loss, perplexity and long-context retrieval accuracy of a checkpoint",
        description="Loads CHECKPOINT_OR_RUN (a checkpoint folder, or a run folder: its latest checkpoint), measures "
        "the validation loss on the run's own data (overrides: data.key=value), then the exact-match accuracy "
        "(with its 95% interval) of the passkey and key-value retrieval tasks over a grid of context lengths and "
        "needle depths. Writes eval.csv, eval.json and retrieval_<task>.png (heatmaps) and prints the tables. A "
        "length that runs out of memory is reported as skipped.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN", help="a checkpoint folder, a run folder or a folder "
                   "written by nsa export --format hf")
    p.add_argument("overrides", nargs="*", metavar="data.key=value", help="overrides of the run's data section")
    p.add_argument("--lengths", default=EVAL_LENGTHS, help=f"comma-separated context lengths in tokens "
                   f"(default {EVAL_LENGTHS})")
    p.add_argument("--depths", default=EVAL_DEPTHS, help="comma-separated needle depths in [0, 1] "
                   "(0: the start of the context; default 0,0.1,...,1)")
    p.add_argument("--samples", type=int, default=32, help="examples per (task, length, depth) cell; each "
                   "accuracy comes with its 95%% interval over them (default 32)")
    p.add_argument("--tasks", default="passkey,kv", help="comma-separated: passkey, kv, multikey (none: validation only)")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches of the run's batch size and "
                   "sequence length (0: skip the validation loss)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per retrieval forward pass")
    p.add_argument("--seed", type=int, default=0, help="seed of the retrieval examples")
    p.add_argument("--out", default=None, help="output folder (default: the run folder's eval/)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto: cuda if present)")
    p.add_argument("--ablate-attention", default="", metavar="LAYERS", help="comma-separated 0-based layers whose "
                   "attention outputs zeros (their MLPs stay): what the scores owe those layers (default output folder: "
                   "the run folder's eval-ablate-LAYERS/)")
    p.add_argument("--ablate-each-layer", action="store_true", help="retrieval with every layer's attention in place, "
                   "then with each layer's removed in turn, as one table and heatmap: which layers the task rests on "
                   "(no validation loss; default output folder: the run folder's eval-ablate-each/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "compare",
        help="compare runs: loss curves, final validation losses, retrieval heatmaps, NSA gate statistics",
        description="Reads each RUN_DIR's metrics.csv, eval/eval.csv (from nsa eval) and nsa_stats.jsonl and writes "
        "compare.md with loss.png (train and validation loss against tokens seen), retrieval_<task>.png (the "
        "runs' heatmaps side by side) and gates.png (each NSA run's gate means at the end of training). Runs of "
        "one attention kind (several train.seed values, reruns of one seed) are summarised by the mean, min, max "
        "and spread over them of the validation loss and of the exact match per task and length: printed, and "
        "written to compare.csv and compare.json.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, e.g. runs/learn-nsa runs/learn-dense")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("config", help="print the resolved configuration (with --docs: every key and its meaning)")
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help=CONFIG_HELP)
    p.add_argument("--docs", action="store_true", help="list every key with its value and description")
    p.set_defaults(func=_cmd_config)

    bench = sub.add_parser("bench", help="benchmarks (GPU): attention, train, decode; plot")
    bench = bench.add_subparsers(dest="bench", required=True)
    p = bench.add_parser(
        "attention",
        help="NSA kernels vs dense SDPA (flash and cuDNN) and fla parallel_nsa, forward and forward+backward",
        description="Times NSA (all branches and gates) against dense causal attention of the same shape (SDPA's "
        "flash and cuDNN backends), and "
        "against fla-core's parallel_nsa where it runs, in one run on one GPU; prints a table and writes CSV/JSON "
        "and a PNG.",
    )
    p.add_argument("--shapes", default="m7c,paper", help="comma-separated: m7c (12/2/64), paper (64/4/128)")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help="comma-separated sequence lengths (default 2048,4096,...,131072; none with --docs)")
    p.add_argument("--out", default="runs/bench", help="folder for the CSV/JSON results")
    p.add_argument("--forward-only", action="store_true", help="skip forward+backward timings")
    p.add_argument("--no-fla", action="store_true", help="skip fla-core's parallel_nsa")
    p.add_argument("--components", type=_int_list, default=[], metavar="T,...",
                   help="also time every forward/backward stage at these lengths")
    p.add_argument("--sweep", type=_int_list, default=[], metavar="T,...",
                   help="also time forward+backward as each kernel launch parameter varies, at these lengths")
    p.add_argument("--sweep-params", default="", metavar="NAME,...",
                   help="only these launch parameters in --sweep (default: all; see nsa/ops/tuning.py)")
    p.add_argument("--batch", type=int, default=1, help="sequences per call (the tables use 1)")
    p.add_argument("--graphs", action="store_true",
                   help="time CUDA-graph replays of every call (NSA, dense, fla): the GPU's time without the host's "
                        "launch time, as in a captured or compiled step; short sequences at batch 1 are host-bound")
    p.add_argument("--triton-packed", action="store_true",
                   help="run packed documents on the Triton kernels only, not Gluon's (TUNING.gluon_packed off; "
                        "docs/kernels.md#packed-documents); recorded under `tuning` in the results' environment")
    p.add_argument("--docs", default=None, metavar="MIXTURE,...",
                   help="packed documents: time NSA with cu_seqlens against NSA unpacked, FlexAttention's document "
                        "mask, varlen flash, cuDNN on jagged tensors and fla's varlen parallel_nsa, for each mixture "
                        "TOTAL:LENGTH or TOTAL:MIN-MAX[@SEED] (e.g. 64k:2k,64k:1k-32k: 64k tokens of documents "
                        "of 2k, or of lengths drawn log-uniformly from 1k to 32k, the last cut to fit); also one "
                        "document packed against unpacked at 8k and 64k")
    p.set_defaults(func=_cmd_bench_attention)

    p = bench.add_parser(
        "train",
        help="training tokens/s, MFU and peak memory: NSA vs dense (run under torchrun for several GPUs)",
        description="Runs the trainer on synthetic tokens for each sequence length, NSA and dense in the same run. "
        "Under `torchrun --nproc_per_node=N -m nsa bench train ...` it measures the N-GPU job.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help=CONFIG_HELP + " (default: m7c)")
    p.add_argument("--seq-lens", type=_int_list, default="2048,8192,32768", help="comma-separated sequence lengths")
    p.add_argument("--attention", default="nsa,dense",
                   help="comma-separated: nsa, dense (SDPA's own kernel choice), dense:BACKEND (SDPA pinned to flash, "
                   "cudnn, efficient or math; dense:flash is docs/performance.md's reference); NSA gets a ratio to "
                   "each")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per micro-batch per rank")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--out", default="runs/bench", help="folder for the CSV/JSON results")
    p.add_argument("--profile", action="store_true",
                   help="also write one step's GPU kernels by time to OUT/profile_<attention>_<T>.txt")
    p.add_argument("--triton-packed", action="store_true",
                   help="run packed documents on the Triton kernels only, not Gluon's (TUNING.gluon_packed off; "
                        "docs/kernels.md#packed-documents); recorded under `tuning` in the results' environment")
    p.set_defaults(func=_cmd_bench_train)

    p = bench.add_parser(
        "decode", help="GPU: per-token decode latency with KV caches, NSA vs dense (CUDA graphs)",
        description="Prefill a random prompt of each context length, then time cached decode steps replayed from "
                    "CUDA graphs (the mean over whole cycles of d steps; NSA runs phi only when a block completes) "
                    "and one layer's decode attention alone, for the NSA model and the dense model of the same shape.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help=CONFIG_HELP + " (default: m7c)")
    p.add_argument("--contexts", type=_int_list, default="4096,8192,16384,32768,65536",
                   help="comma-separated context lengths")
    p.add_argument("--batches", type=_int_list, default="1,16", help="comma-separated batch sizes")
    p.add_argument("--attention", default="nsa,dense", help="comma-separated: nsa, dense")
    p.add_argument("--steps", type=int, default=32,
                   help="timed decode steps, rounded up to whole cycles of d tokens (mean reported)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (no CUDA graphs; for a functional check)")
    p.add_argument("--compile", action="store_true", help="torch.compile each model's decode step (fuses small kernels)")
    p.add_argument("--out", default="runs/bench", help="folder for the CSV/JSON results")
    p.add_argument("--profile", action="store_true",
                   help="also write each step's kernels by time to OUT/profile_decode_<attention>_<context>_b<batch>.txt "
                        "and count the kernels a step launches (kernels_per_step)")
    p.set_defaults(func=_cmd_bench_decode)

    p = bench.add_parser(
        "plot", help="redraw the picture of saved results (no GPU): speed-ups or tokens/s against length",
        description="Draws the PNG that nsa bench attention, decode and train write beside their CSV/JSON, from a "
                    "saved JSON (e.g. runs/bench/attention.json).",
    )
    p.add_argument("results", help="a JSON file written by nsa bench attention, decode or train")
    p.add_argument("--out", default=None, help="the PNG to write (default: the results file's name with .png)")
    p.set_defaults(func=_cmd_bench_plot)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, taking CONFIG and key=value arguments after the flags too (argparse alone ends a
    positional list at the first flag, and would refuse `nsa bench train --steps 6 parallel.mode=ddp`)."""
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # The command's trailing list: CONFIG and key=value (`args`), or key=value alone (`overrides`).
    trailing = next((name for name in ("args", "overrides") if hasattr(ns, name)), None)
    stray = [a for a in extra if a.startswith("-") or trailing is None]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(ns, trailing, [*getattr(ns, trailing), *extra])
    return ns


def main(argv: list[str] | None = None) -> int:
    with pipe_safe_output():
        ns = parse_args(argv)
        try:
            return ns.func(ns)
        except Interrupted as e:
            if e.show:
                print(f"nsa: {e}", file=sys.stderr)
            return e.exit_code
        except UserError as e:
            print(f"nsa: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        except OSError as e:
            if (message := os_error_message(e)) is None:
                raise
            print(f"nsa: error: {message}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
