"""Typed config: YAML presets, key=value overrides, one-line errors, documented fields."""

import dataclasses
from pathlib import Path

import pytest

from nsa.cli import main
from nsa.config import RunConfig, load_config
from nsa.errors import ConfigError
from nsa.model import m7c
from nsa.typed_config import apply_overrides, field_docs, to_dict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def all_dataclasses(cls, seen=None):
    seen = seen if seen is not None else []
    seen.append(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            all_dataclasses(type(default), seen)
    return seen


def test_every_config_field_has_a_docstring():
    for cls in all_dataclasses(RunConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_tiny_yaml_is_the_default_run():
    assert load_config(str(CONFIGS / "tiny.yaml")) == load_config(None)


def test_m7c_yaml_is_the_m7c_preset_with_its_training_recipe():
    cfg = load_config(str(CONFIGS / "m7c.yaml"))
    assert cfg.model == m7c()
    t = cfg.train
    assert (t.seq_len, t.lr, t.weight_decay, t.warmup_steps, t.grad_clip, t.steps, cfg.checkpoint.every, t.seed) == (
        2048, 2e-4, 0.01, 2000, 1.0, 50000, 5000, 1337
    )
    assert cfg.data.tokenizer == "gpt2"


def test_a_yaml_base_is_loaded_first_and_overlaid():
    cfg = load_config(str(CONFIGS / "m7c_fineweb.yaml"))
    assert cfg.model == m7c() and cfg.train.lr == 2e-4  # from the base
    assert (cfg.data.source, cfg.data.hf_name, cfg.data.hf_config) == ("hf", "HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert cfg.parallel.activation_checkpointing is True


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        str(CONFIGS / "m7c.yaml"),
        ["train.steps=100", "model.n_layers=2", "model.nsa.phi=mean", "train.betas=[0.8, 0.9]", "train.lr=1e-3",
         "model.nsa.shared_kv=true", "train.run_name=abc"],
    )
    assert cfg.train.steps == 100 and cfg.model.n_layers == 2 and cfg.model.nsa.phi == "mean"
    assert cfg.train.betas == (0.8, 0.9) and cfg.train.lr == 1e-3 and cfg.model.nsa.shared_kv is True
    assert cfg.train.run_name == "abc" and cfg.model.dim == 768


def test_to_dict_round_trips():
    cfg = apply_overrides(RunConfig(), ["train.steps=7"])
    from nsa.typed_config import from_dict

    assert from_dict(RunConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.stpes=3", r"unknown config key 'train.stpes' \(did you mean 'train.steps'\?\)"),
        ("modle.dim=3", r"unknown config key 'modle' \(did you mean 'model'\?\)"),
        ("train.steps=many", r"train.steps='many' is not valid: expected an integer"),
        ("model.attention=flash", r"expected one of 'nsa', 'dense'"),
        ("model.nsa.block_stride=5", r"model.nsa.block_stride \(5\) must divide model.nsa.block_len"),
        ("model.nsa.sel_block=20", r"must divide .* model.nsa.sel_block \(20\)"),
        ("model.n_kv_heads=3", r"model.n_heads \(4\) must be divisible by model.n_kv_heads \(3\); choose n_kv_heads among 1, 2, 4"),
        ("model.nsa.n_sel=2", r"model.nsa.n_sel must be >= 3"),
        ("train.steps=0", r"train.steps must be >= 1"),
        ("data.val_fraction=1.5", r"data.val_fraction must be in \[0, 1\)"),
        ("train.lr", r"not of the form key=value"),
        ("model.head_dim=31", r"must be even for RoPE"),
        ("train.betas=[0.9]", r"train.betas=\[0.9\] is not valid: expected a list of 2 finite numbers "
                              r"\(e.g. train.betas=\[0.9,0.95\]\)"),
        ("train.betas=0.9", r"train.betas=0.9 is not valid: expected a list of 2 finite numbers"),
        ("train.betas=[0.9, 1.5]", r"train.betas must both be in \[0, 1\)"),
        ("train.lr=nan", r"train.lr='nan' is not valid: expected a finite number"),
        ("train.lr=.inf", r"train.lr=inf is not valid: expected a finite number"),
        ("train.lr=-inf", r"train.lr='-inf' is not valid: expected a finite number"),
        ("train.lr=1e999", r"train.lr='1e999' is not valid: expected a finite number"),
        ("train.lr=-0.1", r"train.lr must be > 0, got -0.1"),
        ("model.rope_theta=nan", r"model.rope_theta='nan' is not valid: expected a finite number"),
        ("data.val_fraction=nan", r"data.val_fraction='nan' is not valid"),
        ("train.weight_decay=-0.01", r"train.weight_decay must be >= 0"),
        ("train.grad_clip=-1", r"train.grad_clip must be >= 0 \(0 disables clipping\)"),
        ("model.norm_eps=0", r"model.norm_eps must be > 0"),
        ("model.init_std=-0.02", r"model.init_std must be > 0"),
        ("telemetry.gate_collapse=0.6", r"telemetry.gate_collapse must be in \[0, 0.5\)"),
        ("data.first_batch_timeout_s=0", r"data.first_batch_timeout_s must be > 0"),
        ("data.retrieval.mix_lengths=4096", r"expected a list of integers"),
    ],
)
def test_bad_values_give_one_line_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  warmup: 10\n")
    with pytest.raises(ConfigError, match="did you mean 'train.warmup_steps'"):
        load_config(str(typo))


@pytest.mark.parametrize("override", ["train.betas=[0.9]", "train.lr=nan", "train.lr=inf", "train.lr=-1"])
def test_bad_numbers_stop_nsa_train_with_one_line(override, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nsa: error: {override.split('=')[0]}") and err.count("\n") == 1, err


@pytest.mark.parametrize("text,holds", [("- train\n- model\n", "a list"), ("hello\n", "the single value 'hello'"),
                                        ("3\n", "the single value 3")])
def test_a_yaml_file_that_is_not_a_mapping_is_one_line_naming_the_file(tmp_path, text, holds, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"nsa: error: config file '{path}' holds {holds} at its top level; it must map sections to keys "
                   "(e.g. 'train:' then '  steps: 100' on the next line)\n")


def test_an_empty_yaml_file_is_the_defaults_and_a_binary_one_is_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(str(empty)) == load_config(None)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ConfigError, match="'.*binary.yaml' is not UTF-8 text"):
        load_config(str(binary))
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(str(tmp_path))


def test_words_yaml_reads_as_booleans_stay_words_for_string_settings_and_switch_boolean_ones():
    cfg = load_config(None, ["train.run_name=on", "telemetry.wandb=yes", "parallel.cudagraphs=off",
                             "data.document_masking=true"])
    assert cfg.train.run_name == "on"
    assert cfg.telemetry.wandb is True and cfg.parallel.cudagraphs is False and cfg.data.document_masking is True
    with pytest.raises(ConfigError, match="train.steps='on' is not valid"):
        load_config(None, ["train.steps=on"])
