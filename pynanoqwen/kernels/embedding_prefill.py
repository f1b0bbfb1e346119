"""Token embedding of a prefill chunk: h[i] = float32(embed_tokens[tokens[start + i]]) for i < m.

The batched form of kernels/embedding.py: the chunk's tokens are already in the engine's `tokens`
buffer (the prompt, docs/DECODE.md), and `start` and `m` are device arrays (int32 [1]), so one
captured graph serves every chunk that fits its bucket of R rows. Rows m .. R - 1 are padding:
they get zeros, so the padding rows that the GEMMs compute along with the real ones hold finite,
deterministic values (their results are never read).

Launch: grid (ceil(hidden / 128), R), 128 threads; thread (x, row) writes h[row, x]. Traffic:
R x hidden x (2 + 4) bytes, 44 MB at R = 2048 and hidden 3584 (~10 us at 4.3 TB/s).
"""

from __future__ import annotations

import functools

from numba import cuda, float32
from numba.core import types

from ..launch import launch
from . import CompileTarget

THREADS = 128


@functools.cache
def _embedding_rows_kernel(hidden_size: int):
    @cuda.jit
    def embedding_rows(table, tokens, start, m, h):
        i = cuda.grid(1)
        row = cuda.blockIdx.y
        if i < hidden_size:
            if row < m[0]:
                h[row, i] = float32(table[tokens[start[0] + row], i])
            else:
                h[row, i] = float32(0.0)

    return embedding_rows


class EmbeddingRows:
    """The embedding of a chunk of tokens for one hidden size; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int):
        self.kernel = _embedding_rows_kernel(hidden_size)
        self.grid_x = -(-hidden_size // THREADS)

    def launch(self, stream, table, tokens, start, m, h) -> None:
        """table float16 [vocab, hidden], tokens int32 [>= start + m], start, m int32 [1]
        -> h float32 [R, hidden] (R = rows of the bucket, >= m; rows >= m are zeroed)."""
        launch(self.kernel, (self.grid_x, h.shape[0]), THREADS, stream, (table, tokens, start, m, h), dependent=False)


def make_embedding_rows(hidden_size: int) -> EmbeddingRows:
    return EmbeddingRows(hidden_size)


def compile_targets() -> list[CompileTarget]:
    """The 7B hidden size and a tiny one."""
    i32 = types.int32[::1]
    signature = types.void(types.float16[:, ::1], i32, i32, i32, types.float32[:, ::1])
    return [CompileTarget(f"embedding_rows[hidden={hidden}]", _embedding_rows_kernel(hidden), signature,
                          ("cvt.f32.f16",))
            for hidden in (3584, 256)]
