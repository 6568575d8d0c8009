"""Pictures of benchmark results: every `nsa bench` command draws one beside its CSV/JSON, and
`nsa bench plot RESULTS.json` redraws one from a saved file (e.g. runs/bench/attention.json).

attention: NSA's speed-up over each dense reference (SDPA flash, cuDNN) and fla-core, per shape, against T;
decode: the speed-up of a whole decode step and of one layer's attention, per batch, against the context;
train: tokens/s of NSA and dense, and their ratio, against the sequence length.
Ratio panels have a log scale and a line at 1 (break-even).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

Series = dict[str, list[tuple[int, float]]]
"""label -> [(x, y)], sorted by x."""

ATTENTION_REFS = {"dense (SDPA flash)": "speedup", "dense (cuDNN)": "vs_cudnn", "fla parallel_nsa": "vs_fla"}
"""Legend label -> the ratio's column prefix in `nsa bench attention`'s rows (suffix _fwd or _fwdbwd)."""
REFERENCE_STYLES = {"dense (SDPA flash)": "-", "dense (cuDNN)": "--", "fla parallel_nsa": ":"}


def _points(rows: list[dict], x: str, y: str) -> list[tuple[int, float]]:
    return sorted((int(r[x]), float(r[y])) for r in rows if r.get(y) is not None and r.get(x) is not None)


def kind_of(rows: list[dict]) -> str:
    """Which benchmark wrote these rows: attention, decode or train."""
    keys = set().union(*rows) if rows else set()
    if "nsa_fwd_ms" in keys:
        return "attention"
    if "context" in keys and "step_ms" in keys:
        return "decode"
    if "seq_len" in keys and "tokens_per_s" in keys:
        return "train"
    raise UserError("these rows are not results of nsa bench attention, decode or train (no known columns); "
                    "pass a JSON file that one of them wrote")


def attention_series(rows: list[dict]) -> dict[str, Series]:
    """{panel: {label: points}}: NSA's speed-up over every reference that has a number, per shape, against T."""
    panels = {}
    for panel, suffix in (("forward", "fwd"), ("forward + backward", "fwdbwd")):
        series = {}
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for label, prefix in ATTENTION_REFS.items():
                points = _points([r for r in rows if r["shape"] == shape], "T", f"{prefix}_{suffix}")
                if points:
                    series[f"{shape} vs {label}"] = points
        if series:
            panels[panel] = series
    return panels


def decode_series(rows: list[dict]) -> dict[str, Series]:
    """{panel: {label: points}}: NSA's decode speed-up over dense per batch size, against the context."""
    nsa = [r for r in rows if r.get("attention") == "nsa"]
    panels = {}
    for panel, column in (("whole decode step", "speedup"), ("one layer's attention", "attention_speedup")):
        series = {f"batch {b}": _points([r for r in nsa if r["batch"] == b], "context", column)
                  for b in sorted({r["batch"] for r in nsa})}
        series = {k: v for k, v in series.items() if v}
        if series:
            panels[panel] = series
    return panels


def dense_references(rows: list[dict]) -> list[str]:
    """`nsa bench train`'s dense rows' labels, in order of appearance: 'dense', 'dense:flash', ..."""
    return list(dict.fromkeys(r["attention"] for r in rows if r["attention"].startswith("dense")))


def ratio_column(reference: str) -> str:
    """`nsa bench train`'s column of tokens/s over a dense row: vs_dense for 'dense', vs_dense_flash for
    'dense:flash'."""
    return "vs_" + reference.replace(":", "_")


def train_series(rows: list[dict]) -> dict[str, Series]:
    """{panel: {label: points}}: tokens/s of each model (and parallel mode), and NSA over dense, against T."""
    def label(r: dict) -> str:
        ranks = r.get("ranks", 1)
        return r["attention"] if ranks == 1 else f"{r['attention']} ({r.get('mode')}, {ranks} GPUs)"

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(label(r), []).append(r)
    panels = {"tokens/s": {k: _points(v, "seq_len", "tokens_per_s") for k, v in groups.items()}}
    references = dense_references(rows) or ["dense"]
    ratios = {f"{k} / {ref}": _points(v, "seq_len", ratio_column(ref))
              for k, v in groups.items() if not k.startswith("dense") for ref in references}
    ratios = {k: v for k, v in ratios.items() if v}
    if ratios:
        panels["NSA / dense tokens/s"] = ratios
    return panels


SERIES = {"attention": (attention_series, "sequence length T", "NSA speed-up (x)"),
          "decode": (decode_series, "context (tokens)", "NSA speed-up per token (x)"),
          "train": (train_series, "sequence length", None)}
ABSOLUTE_PANELS = {"tokens/s"}
"""Panels of plain quantities; every other panel is a ratio (log scale, break-even line)."""


def _tokens(n: float) -> str:
    """2048 -> 2k (lengths are powers of two)."""
    return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def _lines(ax, series: Series) -> None:
    """One line per label; one colour per subject (the part before " vs "), one line style per reference, so
    attention's legend reads as a grid."""
    subjects = list(dict.fromkeys(label.split(" vs ")[0] for label in series))
    for label, points in series.items():
        xs, ys = zip(*points)
        subject, _, reference = label.partition(" vs ")
        ax.plot(xs, ys, marker="o", label=label, color=f"C{subjects.index(subject)}",
                linestyle=REFERENCE_STYLES.get(reference, "-"))


def _ratio_axis(ax, series: Series, label: str) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ys = [y for points in series.values() for _, y in points] + [1.0]  # break-even always in view
    if max(ys) / min(ys) > 4:  # a log scale only where the ratios span more than a factor of 4
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(min(ys) / 1.15, max(ys) * 1.15)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="-.", label="break-even")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_ylabel(label)


def _length_axis(ax, label: str) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)


def draw(panels: dict[str, Series], title: str, footer: str, xlabel: str, ratio_label: str | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        _lines(ax, series)
        _length_axis(ax, xlabel)
        if name in ABSOLUTE_PANELS:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v >= 1000 else f"{v:g}"))
            ax.set_ylabel(name)
        else:
            _ratio_axis(ax, series, ratio_label or name)
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.text(0.5, 0.01, footer, ha="center", fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rows(rows: list[dict], meta: dict, path: str | Path) -> Path:
    """Draw the picture of one benchmark's rows (its kind found from the columns) to path (a PNG)."""
    kind = kind_of(rows)
    make, xlabel, ratio_label = SERIES[kind]
    panels = make(rows)
    if not panels:
        raise UserError(f"nothing to plot: the {kind} results hold no measured numbers")
    env = meta.get("environment", meta)
    footer = "  ".join(f"{k} {env[k]}" for k in ("device", "torch", "triton", "git", "date") if env.get(k))
    return draw(panels, f"nsa bench {kind}", footer, xlabel, ratio_label, Path(path))


def picture(rows: list[dict], meta: dict, path: str | Path) -> tuple[Path, ...]:
    """For the benches: (the PNG,) drawn from their rows, or () where no row has a number to draw (a run whose
    every call ran out of memory, or whose other model was not run): a bench's results never fail on their picture."""
    try:
        return (plot_rows(rows, meta, path),)
    except UserError:
        return ()


def plot_file(json_path: str | Path, out: str | Path | None = None) -> Path:
    """Redraw a saved result: `nsa bench plot FILE.json [--out PNG]` (default: FILE.png)."""
    src = Path(json_path)
    if not src.is_file():
        raise UserError(f"no results file '{src}': pass a JSON that nsa bench attention, decode or train wrote into "
                        "its --out folder (e.g. nsa bench attention --out results/, then results/attention.json)")
    try:
        data = json.loads(src.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{src} is not valid JSON ({e.msg} at line {e.lineno}); "
                        "pass a JSON written by nsa bench") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UserError(f"{src} holds no benchmark rows; pass a JSON written by nsa bench attention, decode or train")
    return plot_rows(data["rows"], data.get("environment", {}), out or src.with_suffix(".png"))
