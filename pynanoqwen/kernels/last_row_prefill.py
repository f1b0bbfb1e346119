"""Hand a prefill chunk over to the decode path: h = h_rows[m - 1], pos = start + m - 1.

After a chunk's layers, only its last row matters for what comes next: the token after the
prompt is sampled from it. Rather than a batched final norm and lm_head, the engine copies that
row into the decode step's float32 `h` and sets `pos` to its position, then runs the decode
step's own final RMSNorm, lm_head and sampler (docs/DECODE.md). Sampling is then the very same
kernels at the very same pos (the sampler's random numbers are keyed by pos), and the sampler
writes tokens[start + m] and advances pos to start + m, as the last prompt step of decode does.
Inside a long prompt (a chunk that is not the last) the engine runs only the "prompt" sampler,
which just advances pos.

Launch: ceil(hidden / 128) blocks of 128 threads, one per element; thread 0 also writes pos (no
thread reads it). 14 KiB at 7B: latency only.
"""

from __future__ import annotations

import functools

from numba import cuda
from numba.core import types

from ..launch import launch
from . import CompileTarget

THREADS = 128


@functools.cache
def _last_row_kernel(hidden_size: int):
    @cuda.jit
    def last_row(h_rows, start, m, h, pos):
        i = cuda.grid(1)
        last = m[0] - 1
        if i < hidden_size:
            h[i] = h_rows[last, i]
        if i == 0:
            pos[0] = start[0] + last

    return last_row


class LastRow:
    """The prefill-to-decode hand-over for one hidden size; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int):
        self.kernel = _last_row_kernel(hidden_size)
        self.grid = -(-hidden_size // THREADS)

    def launch(self, stream, h_rows, start, m, h, pos) -> None:
        """h_rows float32 [>= m, hidden], start, m int32 [1] -> h float32 [hidden], pos int32 [1]."""
        launch(self.kernel, self.grid, THREADS, stream, (h_rows, start, m, h, pos), dependent=False)


def make_last_row(hidden_size: int) -> LastRow:
    return LastRow(hidden_size)


def compile_targets() -> list[CompileTarget]:
    i32 = types.int32[::1]
    signature = types.void(types.float32[:, ::1], i32, i32, types.float32[::1], i32)
    return [CompileTarget(f"last_row[hidden={hidden}]", _last_row_kernel(hidden), signature)
            for hidden in (3584, 256)]
