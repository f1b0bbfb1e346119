"""Token embedding: h = float32(embed_tokens[tokens[pos]]), the first kernel of every decode step.

The token being decoded is not a kernel argument: it is `tokens[pos[0]]`, read from device
memory, so the same captured CUDA graph serves every step (docs/DECODE.md). During the prompt,
`tokens` holds the prompt ids; after it, the sampling kernel writes each new id into
`tokens[pos + 1]` before advancing `pos`.

Launch: ceil(hidden / 128) blocks of 128 threads, one thread per hidden element. One row of the
FP16 table is read (7 KiB at hidden 3584) and widened to the float32 residual stream `h`: the
kernel is launch latency, not bandwidth (bench's kernel table: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools

from numba import cuda, float32
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from . import CompileTarget

THREADS = 128


@functools.cache
def _embedding_kernel(hidden_size: int):
    @cuda.jit
    def embedding(table, tokens, pos, h):
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        # Only after the wait: the QKV GEMV after this kernel reads pos and the page table before
        # its own wait (kernels/gemv_int4_kernel.py), so it must not start before the page
        # allocator has completed.
        launch_dependents()
        i = cuda.grid(1)
        if i < hidden_size:
            h[i] = float32(table[tokens[pos[0]], i])

    return embedding


class Embedding:
    """The embedding lookup for one hidden size; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int):
        self.kernel = _embedding_kernel(hidden_size)
        self.grid = -(-hidden_size // THREADS)

    def launch(self, stream, table, tokens, pos, h) -> None:
        """table float16 [vocab, hidden], tokens int32 [>= pos + 1], pos int32 [1] -> h float32 [hidden]."""
        launch(self.kernel, self.grid, THREADS, stream, (table, tokens, pos, h))


def make_embedding(hidden_size: int) -> Embedding:
    return Embedding(hidden_size)


def compile_targets() -> list[CompileTarget]:
    """The 7B hidden size and a tiny one."""
    signature = types.void(types.float16[:, ::1], types.int32[::1], types.int32[::1], types.float32[::1])
    return [CompileTarget(f"embedding[hidden={hidden}]", _embedding_kernel(hidden), signature, ("cvt.f32.f16",))
            for hidden in (3584, 256)]
