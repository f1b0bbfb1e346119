"""Timing GPU work the way METHOD.md asks: inside captured CUDA graphs, between device events.

A single Numba launch costs ~100-170 us of host dispatch, more than most decode kernels take, so
kernels are captured into a graph (graphs.py) and the graph is replayed many times between two
events. Used by the benchmark (bench.py) and the gpu-marked tests.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import cuda

from .device import l2_bytes
from .graphs import capture


def time_graph(stream, enqueue: Callable[[], None], replays: int = 20) -> float:
    """Seconds per replay of the graph that `enqueue()` records on `stream` (after one warm-up)."""
    enqueue()  # compile and load every kernel before capture
    stream.synchronize()
    graph = capture(stream, enqueue)
    try:
        graph.launch(stream)
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3 / replays
    finally:
        graph.close()


def weight_copies(bytes_per_call: int) -> int:
    """Copies of a call's weights to rotate through so that together they exceed the L2 twice:
    every call then reads its weights from HBM, as in a real decode step or prefill."""
    return max(1, -(-2 * l2_bytes() // bytes_per_call))


def time_gemv(build, bytes_per_call: int, out_dtype, replays: int = 20) -> float:
    """Seconds per call of a GEMV object built by `build()` (.launch(stream, x, out), .n, .k).

    Enough copies of the weights are rotated that together they exceed the L2 twice, so every
    call reads its weights from HBM as it does in a real decode step."""
    copies = weight_copies(bytes_per_call)
    calls = max(copies, 32)
    gemvs = [build() for _ in range(copies)]
    stream = cuda.stream()
    x = cuda.to_device(np.random.default_rng().standard_normal(gemvs[0].k).astype(np.float16), stream=stream)
    out = cuda.device_array(gemvs[0].n, dtype=out_dtype)
    return time_graph(stream, lambda: [gemvs[i % copies].launch(stream, x, out) for i in range(calls)],
                      replays) / calls


def copy_bandwidth(nbytes: int = 2 * 2**30, replays: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = cuda.device_array(nbytes // 4, np.float32)
    dst = cuda.device_array(nbytes // 4, np.float32)
    stream = cuda.stream()
    dst.copy_to_device(src, stream=stream)  # warm-up
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(replays):
        dst.copy_to_device(src, stream=stream)
    end.record(stream)
    end.synchronize()
    return 2 * nbytes * replays / (cuda.event_elapsed_time(start, end) / 1e3)
