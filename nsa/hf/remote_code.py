"""The two small Python files an NSA model folder carries so that transformers loads it in a process that has not
imported nsa (`trust_remote_code=True`, as lm-evaluation-harness or any other tool that knows only transformers).

The files hold no model code: they import NSAConfig and NSAForCausalLM from the installed nsa package and name
them after the folder's files (subclasses, so that transformers' remote-code bookkeeping, which marks the loaded
classes and copies their files when the model is saved again, touches these files and not nsa's own).
"""

from __future__ import annotations

from pathlib import Path

CONFIG_MODULE = "configuration_nsa"
MODEL_MODULE = "modeling_nsa"

AUTO_MAP = {"AutoConfig": f"{CONFIG_MODULE}.NSAConfig", "AutoModelForCausalLM": f"{MODEL_MODULE}.NSAForCausalLM"}
"""config.json's auto_map: the class transformers' Auto classes take from each file under trust_remote_code."""

_NEEDS_NSA = '''
try:  # transformers checks a remote file's imports; this one names the fix when nsa is missing
    import nsa.hf.modeling as nsa_modeling
except ImportError as e:
    raise ImportError(f'this model folder needs the nsa package: pip install "nsa[hf]" ({e})') from e
'''

SOURCES = {
    CONFIG_MODULE: f'''"""NSAConfig of an nsa model folder, from the installed nsa package (trust_remote_code=True)."""
{_NEEDS_NSA}

class NSAConfig(nsa_modeling.NSAConfig):
    """nsa.hf.modeling.NSAConfig, as this folder's configuration class."""
''',
    MODEL_MODULE: f'''"""NSAForCausalLM of an nsa model folder, from the installed nsa package (trust_remote_code=True)."""
{_NEEDS_NSA}
from .{CONFIG_MODULE} import NSAConfig


class NSAForCausalLM(nsa_modeling.NSAForCausalLM):
    """nsa.hf.modeling.NSAForCausalLM, as this folder's model class."""

    config_class = NSAConfig
''',
}
"""Module name -> source of the files written beside config.json."""


def write_remote_code(folder: str | Path) -> None:
    """Write configuration_nsa.py and modeling_nsa.py into `folder` (config.json's auto_map names them)."""
    for module, source in SOURCES.items():
        (Path(folder) / f"{module}.py").write_text(source, encoding="utf-8")
