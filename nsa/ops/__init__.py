"""NSA attention ops: the public entry points, the block geometry and the pure-PyTorch reference."""

from . import reference
from .api import BACKENDS, nsa_attention, select_blocks
from .geometry import NSAGeometry, num_compressed_blocks, num_selection_blocks

__all__ = [
    "BACKENDS",
    "NSAGeometry",
    "nsa_attention",
    "select_blocks",
    "reference",
    "num_compressed_blocks",
    "num_selection_blocks",
]
