"""Hugging Face interoperability: NSAConfig / NSAForCausalLM (nsa.hf.modeling, needs transformers; padded batches in
nsa.hf.padding, the folder's remote-code files in nsa.hf.remote_code), export to a Hugging Face folder
(nsa.hf.export) and reading one back (nsa.hf.folder).

`import nsa` registers the model classes with transformers' Auto classes once transformers is imported (at once
if it already is), so that importing nsa does not import transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def register() -> None:
    """Register NSAConfig and NSAForCausalLM with AutoConfig and AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .modeling import NSAConfig, NSAForCausalLM

    AutoConfig.register("nsa", NSAConfig, exist_ok=True)
    AutoModelForCausalLM.register(NSAConfig, NSAForCausalLM, exist_ok=True)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs register() right after the `transformers` package itself has been imported."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """register() now if transformers is imported, else as soon as it is; nothing if it is not installed."""
    if "transformers" in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())
