"""The decode step as CUDA graphs: captured on first use per (batch rows, attended width, hooked restraint sites),
replayed after (at most `MAX_GRAPHS`, least recently used dropped). The step reads the engine's per-slot `tokens` and
`next_pos` and the cache's buffers, whose addresses never change, so a replay needs no copies; growing the cache
clears the graphs. A model whose forward cannot be captured (a host sync, a data-dependent branch) falls back to
eager with one warning."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

log = logging.getLogger("rolemrc.generate")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPHS = 64   # captured graphs kept (least recently replayed dropped first): sets of hooked sites are unbounded


class DecodeGraphs:
    def __init__(self, engine: Any, max_graphs: int = MAX_GRAPHS) -> None:
        self.engine = engine
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self.broken = False

    def clear(self) -> None:
        self.graphs.clear()

    def decode(self, rows: int, width: int) -> torch.Tensor:
        """Logits [rows', 1, vocab] of the decode step over slots [0, rows'), rows' >= rows a captured size."""
        engine = self.engine
        if self.broken:
            return engine.decode_forward(rows, width)
        rows = min(next((b for b in BUCKETS if b >= rows), engine.slots), engine.slots)
        key = (rows, width, engine.scales.sites)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(rows, width)
            except Exception as exc:   # any capture failure means: run eager
                log.warning("the decode step cannot be captured as a CUDA graph (%s: %s); decoding eagerly",
                            type(exc).__name__, exc)
                self.broken = True
                torch.cuda.synchronize()
                return engine.decode_forward(rows, width)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        engine = self.engine
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up: the same step, so what it writes the replay writes again
            engine.decode_forward(rows, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = engine.decode_forward(rows, width)
        return graph, logits
