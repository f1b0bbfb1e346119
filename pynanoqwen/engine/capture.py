"""The schedule's launch lists as CUDA graphs (pynanoqwen/graphs.py), one graph per list.

A list is captured only after it has run once eagerly: Numba compiles a kernel at its first
launch, and compiling and loading a module is not something to do inside a capture. The decode
graphs are captured at load: {prompt, argmax, candidates} (kernels/sampling.py) x {same page, new
page}, since a step at a position p with p % PAGE_SIZE == 0 starts a KV page and so begins with
page_alloc. The prefill graphs, one per (bucket of rows, sampling method), are captured on first use.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..graphs import CudaGraph, capture
from .schedule import Launch, run_all


class GraphCache:
    """Captured graphs of launch lists, by key."""

    def __init__(self, stream):
        self.stream = stream
        self.graphs: dict[Hashable, CudaGraph] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def __iter__(self):
        return iter(self.graphs)

    def capture(self, key: Hashable, launches: list[Launch]) -> None:
        """Record `launches` (every kernel among them already compiled) as the graph of `key`."""
        self.graphs[key] = capture(self.stream, lambda: run_all(launches, self.stream))

    def launch(self, key: Hashable) -> None:
        self.graphs[key].launch(self.stream)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
