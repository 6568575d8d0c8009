"""What does retrieval owe each layer? Evaluating with a layer's attention removed answers it.

`ablated_attention` replaces the output of the named layers' attention by zeros for as long as it is active:
the residual stream then passes those layers with their MLPs alone. A model whose accuracy does not move
without a layer's attention never used it for the task; one that loses the task without it depended on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import UserError


def parse_layers(text: str, option: str = "--ablate-attention") -> list[int]:
    """'3,2' -> [2, 3] (0-based layer indices, sorted, each once); '' -> []; a clear error for anything else."""
    layers: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise UserError(f"{option}: '{part}' is not a layer index; give 0-based indices such as 2,3")
        layers.add(int(part))
    return sorted(layers)


def check_layers(model: nn.Module, layers: list[int]) -> None:
    """A clear error unless every index names one of model.layers."""
    missing = [i for i in layers if not 0 <= i < len(model.layers)]
    if missing:
        raise UserError(f"--ablate-attention: layer {missing[0]} does not exist; the model has layers "
                        f"0-{len(model.layers) - 1}")


@contextlib.contextmanager
def ablated_attention(model: nn.Module, layers: list[int]) -> Iterator[None]:
    """While active, the attention of `layers` (indices into model.layers) outputs zeros [B,T,dim]."""
    check_layers(model, layers)
    hooks = [model.layers[i].attn.register_forward_hook(_zero_output) for i in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _zero_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(output)
