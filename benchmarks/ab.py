"""A/B timing of NSA attention: two variants run in turn on the same inputs; per-variant medians and their ratio.

    python benchmarks/ab.py OUT_DIR --revisions A B [--cases m7c:2048x16,m7c:65536x1] [--rounds 6] [--reps 20]
                            [--timing queued|call|graphs] [--forward-only] [--device cuda|cpu]
    python benchmarks/ab.py OUT_DIR --param NAME=A,B [the same options]

A variant is either a git revision of this repository (`worktree`: the files as they are now, uncommitted edits
included), whose nsa/ is exported to a temporary folder and imported from there, or one value of a launch
parameter or switch of nsa/ops/tuning.py (a field of TUNING), e.g. `--param gluon_stages=2,3` or
`--param branch_streams=true,false`. Each variant runs in a process of its own on the same device, with the same
random inputs; the processes take turns, never overlap, and time with the same code (this file).

A case is SHAPE:TxB: SHAPE is m7c (12/2/64), paper (64/4/128) or H/G/D (query heads / key-value heads / head dim),
T tokens, B sequences; NSA runs with l=32, d=16, l'=64, n=16, w=512 and every branch and gate. Each case times the
forward (without autograd) and forward+backward (unless --forward-only). Round 0 warms both variants up and is
dropped; the later rounds alternate which variant goes first, so drift (clocks, temperature) falls on both.
A sample is --reps calls: `call` times each call alone (host launches included, as a caller sees it) and takes the
median; `queued` runs them back to back (the GPU's time per call while the host keeps ahead); `graphs` replays a
CUDA graph of the call (GPU time alone).

Prints a table and writes OUT_DIR/ab.csv and OUT_DIR/ab.json: the median of each variant and a/b, the ratio of
the medians (above 1: b is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
WORKTREE = "worktree"
SHAPES = {"m7c": (12, 2, 64), "paper": (64, 4, 128)}
"""name: (query heads, key/value heads, head dim)."""
HP = dict(block_len=32, block_stride=16, sel_block=64, n_sel=16, window=512)
PASSES = ("fwd", "fwd+bwd")
TIMINGS = ("queued", "call", "graphs")
DEFAULT_CASES = "m7c:2048x16,m7c:8192x4,m7c:65536x1,paper:8192x1,paper:65536x1"


@dataclasses.dataclass(frozen=True)
class Case:
    """One input size: `shape` as given (a name or H/G/D), its heads and head dim, T tokens, B sequences."""

    shape: str
    heads: int
    groups: int
    head_dim: int
    T: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.shape}:{self.T}x{self.batch}"


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one side runs: `label`, the revision it imports nsa from (None: this tree), the TUNING fields it sets."""

    label: str
    revision: str | None = None
    settings: tuple[tuple[str, object], ...] = ()


# ----------------------------------------------------------------------------------------------- argument parsing


def parse_case(text: str) -> Case:
    """SHAPE:TxB (SHAPE a name of SHAPES or H/G/D) as a Case; ValueError naming the expected form otherwise."""
    shape, _, size = text.partition(":")
    T, _, batch = size.partition("x")
    if shape in SHAPES:
        dims = SHAPES[shape]
    else:
        parts = shape.split("/")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"case {text!r}: the shape is m7c, paper or H/G/D, e.g. m7c:2048x16 or 16/4/64:8192x1")
        dims = tuple(int(p) for p in parts)
    if not (T.isdigit() and batch.isdigit() and int(T) > 0 and int(batch) > 0):
        raise ValueError(f"case {text!r}: expected SHAPE:TxB with positive T and B, e.g. m7c:2048x16")
    heads, groups, head_dim = dims
    if heads % groups:
        raise ValueError(f"case {text!r}: the key/value heads ({groups}) must divide the query heads ({heads})")
    return Case(shape, heads, groups, head_dim, int(T), int(batch))


def parse_value(text: str, default: object) -> object:
    """`text` as a value of the type of a TUNING field whose default is `default`."""
    if isinstance(default, bool):
        words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
        if text.lower() not in words:
            raise ValueError(f"{text!r} is not a boolean (true or false)")
        return words[text.lower()]
    kind = {int: "an integer", float: "a number"}.get(type(default), type(default).__name__)
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {kind}") from None


def parse_param(text: str, defaults: dict[str, object]) -> tuple[Variant, Variant]:
    """NAME=A,B as the two variants that set TUNING.NAME to A and to B; `defaults` maps each field to its default."""
    name, _, values = text.partition("=")
    if name not in defaults:
        raise ValueError(f"--param {text!r}: {name!r} is not a field of TUNING (nsa/ops/tuning.py)")
    parts = values.split(",")
    if len(parts) != 2:
        raise ValueError(f"--param {text!r}: expected NAME=A,B (two values), e.g. {name}={defaults[name]},...")
    try:
        a, b = (parse_value(p.strip(), defaults[name]) for p in parts)
    except ValueError as e:
        raise ValueError(f"--param {text!r}: {e}") from None
    if a == b:
        raise ValueError(f"--param {text!r}: the two values are the same")
    return Variant(f"{name}={a}", None, ((name, a),)), Variant(f"{name}={b}", None, ((name, b),))


def tuning_defaults() -> dict[str, object]:
    """Every TUNING field of this tree with its default value."""
    from nsa.ops.tuning import Tuning

    return {f.name: f.default for f in dataclasses.fields(Tuning)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ab.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("out_dir", metavar="OUT_DIR", help="folder for ab.csv and ab.json")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--revisions", nargs=2, metavar=("A", "B"),
                       help=f"two git revisions (or {WORKTREE}: the files as they are now)")
    which.add_argument("--param", metavar="NAME=A,B", help="two values of one TUNING field")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated SHAPE:TxB (default {DEFAULT_CASES})")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (after one warm-up round)")
    ap.add_argument("--reps", type=int, default=20, help="calls per sample")
    ap.add_argument("--timing", choices=TIMINGS, default="queued")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the PyTorch reference, for a functional check of this script")
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Case], tuple[Variant, Variant]]:
    """The command line as (options, cases, the two variants); a bad argument exits with a one-line error."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be at least 1")
    if args.timing == "graphs" and args.device == "cpu":
        ap.error("--timing graphs needs --device cuda")
    try:
        cases = [parse_case(c) for c in args.cases.split(",") if c]
        if args.param:
            variants = parse_param(args.param, tuning_defaults())
        else:
            a, b = args.revisions
            if a == b:
                raise ValueError(f"--revisions: both are {a!r}")
            variants = Variant(a, a), Variant(b, b)
    except ValueError as e:
        ap.error(str(e))
    if not cases:
        ap.error("--cases is empty")
    return args, cases, variants


# ------------------------------------------------------------------------------------------------ revisions


def export_revision(repo: Path, revision: str, dest: Path) -> Path:
    """A folder holding `revision`'s nsa/ package, importable by putting the folder first on sys.path: the
    repository itself for WORKTREE, else dest/<commit> filled from `git archive`. ValueError if git does not
    know the revision."""
    if revision == WORKTREE:
        return repo
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise ValueError(f"{revision!r} is not a revision of {repo} (or use {WORKTREE!r} for the files as they are)")
    commit = found.stdout.strip()
    folder = dest / commit
    if not (folder / "nsa").is_dir():
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit, "nsa"],
                                 capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(folder, filter="data")
    return folder


# ------------------------------------------------------------------------------------------------- arithmetic


def round_order(round_index: int) -> tuple[int, int]:
    """Which variant goes first in a round: a, b in even rounds, b, a in odd ones."""
    return (0, 1) if round_index % 2 == 0 else (1, 0)


def summarize(a_ms: list[float], b_ms: list[float]) -> tuple[float, float, float]:
    """(median of a, median of b, their ratio a/b): above 1, b is faster."""
    a, b = statistics.median(a_ms), statistics.median(b_ms)
    return a, b, a / b


# --------------------------------------------------------------------------------------------- the two processes


class Worker:
    """One variant's process: `python ab.py --worker SOURCE` imports nsa from SOURCE, sets the variant's TUNING
    fields, then answers one JSON request per line with one JSON reply per line."""

    def __init__(self, variant: Variant, source: Path, device: str):
        self.variant = variant
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(source), "--device", device,
                   "--settings", json.dumps(dict(variant.settings))]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=ROOT)
        self.hello: dict = {}

    def wait_ready(self) -> None:
        """Read the process's first reply: where it imported nsa from and its device."""
        self.hello = self._reply()
        if "error" in self.hello:
            raise SystemExit(f"ab.py: error: variant {self.variant.label}: {self.hello['error']}")

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"ab.py: error: variant {self.variant.label}: its process ended (its error is above)")
        return json.loads(line)

    def time(self, case: Case, pass_name: str, timing: str, reps: int) -> float | None:
        """Milliseconds per call of one sample, or None where the device ran out of memory."""
        request = {"case": dataclasses.asdict(case), "pass": pass_name, "timing": timing, "reps": reps}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise SystemExit(f"ab.py: error: variant {self.variant.label} at {case.name} {pass_name}: {reply['error']}")
        return reply["ms"]

    def close(self) -> None:
        """End the process: it exits when its input closes."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def measure(workers: tuple[Worker, Worker], case: Case, pass_name: str, args: argparse.Namespace) -> dict:
    """One table row: both variants' samples over the rounds (round 0 dropped), their medians and a/b."""
    samples: tuple[list[float], list[float]] = ([], [])
    for r in range(args.rounds + 1):
        for side in round_order(r):
            ms = workers[side].time(case, pass_name, args.timing, args.reps)
            if ms is None:
                return {"case": case.name, "pass": pass_name, "a_ms": None, "b_ms": None, "a/b": None}
            if r:
                samples[side].append(ms)
    a, b, ratio = summarize(*samples)
    return {"case": case.name, "pass": pass_name, "a_ms": a, "b_ms": b, "a/b": ratio,
            "a_samples": " ".join(f"{x:.4f}" for x in samples[0]),
            "b_samples": " ".join(f"{x:.4f}" for x in samples[1])}


def main(argv: list[str] | None = None) -> None:
    args, cases, variants = parse_args(argv)
    from nsa.bench.common import environment, format_table, print_row, write_results

    passes = PASSES[:1] if args.forward_only else PASSES
    columns = ["case", "pass", "a_ms", "b_ms", "a/b"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="nsa-ab-") as tmp:
        try:
            sources = [export_revision(ROOT, v.revision, Path(tmp)) if v.revision else ROOT for v in variants]
        except ValueError as e:
            raise SystemExit(f"ab.py: error: {e}") from None
        workers = tuple(Worker(v, s, args.device) for v, s in zip(variants, sources))
        try:
            for worker in workers:
                worker.wait_ready()
            for side, worker in zip("ab", workers):
                print(f"{side}: {worker.variant.label}  (nsa from {worker.hello['nsa']}, {worker.hello['device']})")
            for case in cases:
                for pass_name in passes:
                    rows.append(measure(workers, case, pass_name, args))
                    print_row(rows[-1], columns)
        finally:
            for worker in workers:
                worker.close()
    meta = environment() | {"device": workers[0].hello["device"], "a": variants[0].label, "b": variants[1].label,
                            "timing": args.timing, "rounds": args.rounds, "reps": args.reps,
                            **{f"nsa_{k}": v for k, v in HP.items()}}
    csv_path, json_path = write_results(rows, args.out_dir, "ab", meta)
    print(f"\na: {variants[0].label}, b: {variants[1].label}, {args.timing}, ms per call; a/b above 1: b is faster")
    print(format_table(rows, columns))
    print(f"wrote {csv_path} and {json_path}")


# ------------------------------------------------------------------------------------------- inside a variant


class Timer:
    """Milliseconds between start() and stop(): CUDA events on a GPU (the device's clock), else the host's clock."""

    def __init__(self, device: str):
        import time

        import torch

        self.cuda = device == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.clock = time.perf_counter

    def start(self) -> None:
        self.sync()
        if self.cuda:
            self.events[0].record()
        else:
            self.t0 = self.clock()

    def stop(self) -> float:
        if self.cuda:
            self.events[1].record()
            self.sync()
            return self.events[0].elapsed_time(self.events[1])
        return (self.clock() - self.t0) * 1e3


def sample_ms(fn: Callable[[], object], timing: str, reps: int, timer: Timer) -> float:
    """One sample of `reps` calls of fn after one untimed call (the other variant ran last)."""
    fn()
    if timing == "call":
        times = []
        for _ in range(reps):
            timer.start()
            fn()
            times.append(timer.stop())
        return statistics.median(times)
    timer.start()
    for _ in range(reps):
        fn()
    return timer.stop() / reps


def make_call(nsa_attention, case: Case, pass_name: str, device: str) -> Callable[[], object]:
    """The call to time: NSA on random inputs of `case` (the same in every variant: a fixed seed), forward without
    autograd or forward+backward."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device).manual_seed(0)
    B, T, H, G, D = case.batch, case.T, case.heads, case.groups, case.head_dim
    nc = 0 if T < HP["block_len"] else (T - HP["block_len"]) // HP["block_stride"] + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    ins = [rnd(B, T, H, D), rnd(B, nc, G, D), rnd(B, nc, G, D), *(rnd(B, T, G, D) for _ in range(4)),
           torch.rand(B, T, H, 3, generator=g, device=device, dtype=dtype)]
    for t in ins:
        t.requires_grad_()
    if pass_name == "fwd":
        def forward():
            with torch.no_grad():
                return nsa_attention(*ins, **HP)
        return forward
    grad_out = rnd(B, T, H, D)

    def forward_backward():
        for t in ins:
            t.grad = None
        nsa_attention(*ins, **HP).backward(grad_out)

    return forward_backward


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph (warmed up on a side stream first); the replay holds fn, and with it the inputs
    the graph reads."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(fn: Callable[[], object] = fn) -> None:
        graph.replay()

    return replay


def worker(argv: list[str]) -> None:
    """The variant's side: replies go to the original stdout, everything else the process prints to stderr."""
    ap = argparse.ArgumentParser(prog="ab.py --worker")
    ap.add_argument("source")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--settings", default="{}")
    args = ap.parse_args(argv)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    sys.path.insert(0, args.source)
    try:
        import torch

        import nsa
        from nsa.ops import nsa_attention

        settings = json.loads(args.settings)
        if settings:
            from nsa.ops.tuning import TUNING

            for name, value in settings.items():
                if not hasattr(TUNING, name):
                    raise ValueError(f"{name} is not a field of TUNING in {args.source}")
                setattr(TUNING, name, value)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA device (--device cpu runs the PyTorch reference)")
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    reply({"nsa": str(Path(nsa.__file__).parent), "device": device_name})
    timer = Timer(args.device)
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for line in sys.stdin:
        request = json.loads(line)
        case, pass_name = Case(**request["case"]), request["pass"]
        try:
            if (case.name, pass_name) not in calls:
                if any(name != case.name for name, _ in calls):  # a new case: free the last one's inputs
                    calls.clear()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                call = make_call(nsa_attention, case, pass_name, args.device)
                calls[case.name, pass_name] = graphed(call) if request["timing"] == "graphs" else call
            reply({"ms": sample_ms(calls[case.name, pass_name], request["timing"], request["reps"], timer)})
        except torch.cuda.OutOfMemoryError:
            calls.clear()
            torch.cuda.empty_cache()
            reply({"ms": None})
        except Exception as e:  # noqa: BLE001 - reported to the parent as one line
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
