"""Decoding through CUDA graphs: one graph replay per token instead of hundreds of kernel launches.

At decode batch sizes a step's kernels are tiny, so launching them from Python costs more than
running them. GraphedDecoder captures the step (optionally compiled first) once per variant and
replays it. There are two variants: with the compressed emission, for steps where some
sequence's token completes a block, and without it, for the d - 1 other steps in d. The host
tracks every sequence's length (DecodeCache.host_lengths) and picks the variant. Shapes are
static because the cache is preallocated; positions live on the device and advance there.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .cache import DecodeCache, NSALayerCache
from .decode import advance, step_logits


class GraphedDecoder:
    """decode_step(model, token, cache) for one cache, replayed from CUDA graphs (run eagerly off CUDA or
    with the reference NSA backend).

    Build it after prefill. Each variant is captured on its first use. Its warm-up steps write the
    current position's keys and values, which the real step then overwrites; the emitted-block counts
    are put back. The logits returned are a fresh tensor each call.
    """

    def __init__(self, model: nn.Module, cache: DecodeCache, compile: bool = False):
        self.model, self.cache = model, cache
        self.body: Callable = torch.compile(step_logits, dynamic=False) if compile else step_logits
        # The PyTorch reference backend syncs with the host inside a step, which a graph cannot hold.
        self.use_graphs = cache.lengths.is_cuda and model.cfg.nsa.backend != "reference"
        self.token = torch.zeros_like(cache.lengths)
        self.graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _run(self, emit: bool) -> torch.Tensor:
        return self.body(self.model, self.token, self.cache.layers, self.cache.lengths, emit)

    def _replay(self, emit: bool) -> torch.Tensor:
        if emit not in self.graphs:
            self.graphs[emit] = self._capture(emit)
        graph, logits = self.graphs[emit]
        graph.replay()
        return logits.clone()

    def _capture(self, emit: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        nsa_layers = [c for c in self.cache.layers if isinstance(c, NSALayerCache)]
        counts = [c.n_cmp.clone() for c in nsa_layers]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles (if asked) and runs the Triton autotuning outside the capture
                self._run(emit)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(emit)
        for layer, count in zip(nsa_layers, counts):
            layer.n_cmp.copy_(count)  # the warm-up steps' emissions must not count twice
        return graph, logits

    @torch.no_grad()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Append token [B] at each sequence's next position; its logits [B,V]."""
        return self._step(token, self.use_graphs)

    @torch.no_grad()
    def step_eagerly(self, token: torch.Tensor) -> torch.Tensor:
        """The same step launched kernel by kernel (what a profiler can see inside)."""
        return self._step(token, False)

    def _step(self, token: torch.Tensor, replay: bool) -> torch.Tensor:
        self.token.copy_(token)
        return advance(self.cache, self._replay if replay else self._run)
