"""The NSA layer on packed documents: each document of a [B, T] batch is its own sequence, with positions from 0
(docs/design.md#packed-documents)."""

import torch

from nsa.model.attention import NSAAttention
from nsa.model.config import ModelConfig, NSAParams
from nsa.model.documents import Documents
from nsa.model.rope import RotaryEmbedding


def test_a_packed_batch_through_the_nsa_layer_equals_each_document_alone():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64,
                      nsa=NSAParams(block_len=4, block_stride=2, sel_block=4, n_sel=3, window=5, phi="mlp",
                                    phi_hidden=8, gate_hidden=8))
    layer = NSAAttention(cfg).double()
    torch.nn.init.normal_(layer.compress_k.fc2.weight)
    rope = RotaryEmbedding(8)
    B, T = 2, 19
    # Row 0: documents of 7, 1 and 11 tokens; row 1: one document of 19; padded with empty documents.
    cu = torch.tensor([0, 7, 8, 19, 38, 38, 38], dtype=torch.int32)
    documents = Documents.from_cu_seqlens(cu, B, T)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    cos, sin = rope(documents.positions)
    out = layer(x, cos.double(), sin.double(), documents=documents)
    for row, (a, b) in [(0, (0, 7)), (0, (7, 8)), (0, (8, 19)), (1, (0, 19))]:
        c, s = rope(torch.arange(b - a))
        alone = layer(x[row:row + 1, a:b], c.double(), s.double())
        torch.testing.assert_close(out[row:row + 1, a:b], alone)
