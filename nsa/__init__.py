"""nsa: language models with DeepSeek's Native Sparse Attention."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import nsa` (e.g. for the CLI's --help) does not pay for torch.
    if name == "NSAAttention":
        from .model.attention import NSAAttention

        return NSAAttention
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")
