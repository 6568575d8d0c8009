"""NSA attention ops: the public entry points, the block geometry and the pure-PyTorch reference.

- api.py: `nsa_attention` and `select_blocks`, which pick a backend (reference or kernels) for the inputs' device;
- geometry.py: `NSAGeometry`, the five hyper-parameters and their rules, and the block formulas;
- validation.py: the tensors' shapes against the geometry;
- reference.py: the oracle every fast path is checked against;
- custom_ops.py: the kernels' stages as the custom ops `nsa::forward` and `nsa::backward`;
- dispatch.py: which kernel serves each stage (Triton or Gluon), the selected branch's path, side streams;
- branches.py: the names the dispatcher and the kernels share; streams.py: the side CUDA stream;
- tuning.py: the kernels' launch parameters and switches (`TUNING`);
- triton/: the Triton kernels, one module per kernel family; gluon/: the Gluon kernels for Hopper GPUs.
"""

from . import reference
from .api import BACKENDS, nsa_attention, select_blocks
from .geometry import NSAGeometry, compressed_offsets, num_compressed_blocks, num_selection_blocks

__all__ = [
    "BACKENDS",
    "NSAGeometry",
    "compressed_offsets",
    "nsa_attention",
    "select_blocks",
    "reference",
    "num_compressed_blocks",
    "num_selection_blocks",
]
