"""benchmarks/select_variants.py and decode_variants.py time the kernels against copies with one source edit
each: every edit must still find its text in the shipped kernel file, and every edited copy must import (its
kernels compile on the GPU, where the scripts run)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["select_variants", "decode_variants"])
def test_every_variant_applies_to_the_shipped_kernels(name, tmp_path):
    script = _script(name)
    assert len(script.VARIANTS) > 1
    for variant, edits in script.VARIANTS.items():
        module = script.load_variant(variant, edits, tmp_path)
        source = Path(module.__file__).read_text()
        assert all(new in source for _, new in edits), variant


def test_a_stale_edit_is_refused(tmp_path):
    script = _script("decode_variants")
    with pytest.raises(SystemExit, match="is not in"):
        script.load_variant("stale", [("text the kernels no longer contain", "x")], tmp_path)
