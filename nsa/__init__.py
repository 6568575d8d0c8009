"""nsa: language models with DeepSeek's Native Sparse Attention."""

__version__ = "0.1.0"

from .hf import register_when_imported

# NSAConfig / NSAForCausalLM join transformers' Auto classes once transformers is imported (if it is installed).
register_when_imported()


def __getattr__(name):
    # Lazy so that `import nsa` (e.g. for the CLI's --help) does not pay for torch.
    if name == "NSAAttention":
        from .model.attention import NSAAttention

        return NSAAttention
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")
