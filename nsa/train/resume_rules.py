"""What a resumed run may change: each config key is either fixed by the checkpoint or applied from the resumed step.

Keys that shape the model or the data stream are fixed: the weights, the optimizer state and the saved data
position only mean something for the config that made them. Everything else (the length of the run and its
schedule, the optimizer's hyper-parameters, logging, checkpoints, parallelism, kernels, telemetry) takes effect
from the resumed step as written, and the run's config.yaml and heartbeat record the change. So does the shape of
the batches (sequence length, batch size, accumulation, mixed retrieval lengths): a length curriculum resumes one
run at a longer context, and its stream continues from the saved position in the new shape.
"""

from __future__ import annotations

import copy
from typing import Any

FIXED = "fixed"
APPLIED = "applied"

_FIXED_PREFIXES = ("model.", "data.", "train.seed")
_APPLIED_EXCEPTIONS = (
    "model.dense_backend",  # which kernel computes dense attention, not what it computes
    "model.nsa.backend",
    "model.init_std",  # used only to initialise weights, which the checkpoint replaces
    "model.init_from",  # likewise
    "data.prefetch",
    "data.first_batch_timeout_s",
    "data.retrieval.mix_lengths",  # the batch shape of a length curriculum, like train.seq_len
    # Loss terms on the gates: they change the gradient, not the weights' shapes or what the model computes, so a
    # curriculum can turn them on at a later stage.
    "model.nsa.gate_spread_penalty",
    "model.nsa.gate_floor",
    # Likewise the selection distillation's KL term (a gradient on the scores, no weight of its own).
    "model.nsa.selection_distill",
    "model.nsa.selection_distill_queries",
    # The sliding window's length: no weight depends on it, so a curriculum can widen it at a later stage (a short
    # window while the selection learns to fetch what a long one would hold; docs/evaluation.md, the 4k switch).
    "model.nsa.window",
    # Stochastic depth on the attention: a regulariser of training, no weight depends on it.
    "model.attention_drop",
)

_RETRIEVAL_SHAPES = ("train.seq_len", "train.batch_size", "data.retrieval.mix_lengths")
"""Applied on resume where data.source is 'retrieval': each of its batches is drawn from (seed, rank, batch index)
alone, so the stream continues at any length and count, and a curriculum of lengths is one run resumed stage by
stage (configs/recipes/retrieval.yaml)."""

_RUN_IDENTITY = ("train.out_dir", "train.run_name", "checkpoint.resume")
"""Keys that say where the run lives and what it resumes from, not how it trains: never reported as changes."""

ADDED_KEYS: dict[str, Any] = {"data.document_masking": False}
"""Keys added to the config whose default does something other than what runs saved before them did, with the
value that reproduces those runs: a saved config that lacks such a key is read with this value."""

RULE_DOCS = {
    FIXED: "on resume: fixed (shapes the model or the data stream; a changed value is refused)",
    APPLIED: "on resume: applied from the resumed step, and recorded",
}


def resume_rule(key: str) -> str:
    """FIXED or APPLIED for a dotted config key such as 'train.lr'."""
    if key in _APPLIED_EXCEPTIONS:
        return APPLIED
    if any(key == p or key.startswith(p) for p in _FIXED_PREFIXES):
        return FIXED
    return APPLIED


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'train.lr': 0.002, ...} from a nested config mapping."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def with_added_keys(saved: dict) -> dict:
    """A saved config mapping with every ADDED_KEYS key it lacks set to the value its run trained with."""
    out = copy.deepcopy(saved)
    for key, value in ADDED_KEYS.items():
        *sections, name = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node.setdefault(name, value)
    return out


def config_changes(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, new value)} for every key whose value differs; keys the saved config lacks (added to
    the config since it was written) are not changes."""
    old, now = flatten(saved), flatten(new)
    return {key: (old[key], value) for key, value in now.items()
            if key in old and key not in _RUN_IDENTITY and _plain(old[key]) != _plain(value)}


def split_changes(changes: dict[str, tuple[Any, Any]], data_source: str = "") -> tuple[dict, dict]:
    """(fixed changes, applied changes) for a run whose data.source is `data_source`."""
    fixed = {k: v for k, v in changes.items()
             if resume_rule(k) == FIXED and not (data_source == "retrieval" and k in _RETRIEVAL_SHAPES)}
    return fixed, {k: v for k, v in changes.items() if k not in fixed}


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    """'train.lr 0.002 -> 0.01, train.steps 500 -> 800'."""
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
