"""RMSNorm of rows of the residual stream: xn[r] = float16(h[r] * rsqrt(mean(h[r]^2) + eps) * weight).

Decode normalises one row (the token being decoded); prefill normalises R rows, one per prompt
token of the chunk (R = the bucket's rows), feeding the tensor-core GEMMs (kernels/gemm_int4.py).
Padding rows of a prefill chunk are normalised too: they are finite (embedding_prefill.py zeroes
them), whatever they become is never read, and a fixed grid keeps the launch the same for every
chunk of a bucket. In decode the norm runs before a GEMV only where the GEMV does not apply it
itself (the prmt GEMVs fuse it: kernels/gemv_int4.py, norm_weight=): for an FP16 lm_head and,
inside the GEMV object, on the dp4a path. The residual adds
happen in the epilogues of the o_proj and down_proj GEMVs, so this kernel only reads the float32
stream `h` and writes the FP16 activation the next matrix product reads (docs/DECODE.md).

Launch: one block per row. Decode uses one block of min(1024, hidden) threads (one row: all the
latency hiding must come from that block); prefill uses 256 threads a row (many rows: several
blocks per SM beat one large block per row). Thread t owns elements t, t + threads, ... (14 at
7B in prefill), and holds them in registers: it loads its weights before the grid-dependency wait
(no kernel writes them) and all its elements of h at once after it, so a row costs one round trip
to memory for h. Before, a loop loaded and summed (its PTX: 15 loads for a thread's 28 elements
of h and weight, so several round trips) and then read h again to scale it: 10.7 us a launch at
512 rows on an H100, ~1 TB/s, where the bytes take ~5 us at the copy rate; now 3.6 us, the copy
rate (docs/PERFORMANCE.md, "2026-12-06, night"). Each
thread sums its squares in float32, in element order, `warp_sum` folds each warp, the warp totals
meet in shared memory, then every warp folds those totals itself, so all threads learn the sum
after a single `syncthreads`; then each thread scales and writes its elements. Traffic: rows x hidden x
(4 + 2 + 2) bytes: 28 KiB per row at hidden 3584, so decode's launch is latency, not bandwidth
(its time per launch inside a graph: docs/PERFORMANCE.md). The float32
sum of squares is accurate to ~1e-6 relative at these sizes, well under the FP16 output rounding.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.warp import warp_sum
from . import CompileTarget

DECODE_THREADS = 1024
PREFILL_THREADS = 256


@functools.cache
def _rmsnorm_kernel(hidden_size: int, eps: float, threads: int):
    warps = threads // 32
    inv_n = np.float32(1.0 / hidden_size)
    eps32 = np.float32(eps)
    ITEMS = -(-hidden_size // threads)  # elements a thread owns
    WHOLE = hidden_size % threads == 0  # every thread owns ITEMS of them

    @cuda.jit
    def rmsnorm(h, weight, xn):
        launch_dependents()
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        # The weight is no kernel's output: its loads go out before the wait.
        w = cuda.local.array(ITEMS, float32)
        for j in range(ITEMS):
            if WHOLE or tid + j * threads < hidden_size:
                w[j] = float32(weight[tid + j * threads])
        grid_dependency_wait()  # h comes from the previous kernel (launch.py)
        x = cuda.local.array(ITEMS, float32)
        for j in range(ITEMS):  # every load in flight at once: one round trip, not one an element
            x[j] = h[row, tid + j * threads] if WHOLE or tid + j * threads < hidden_size else float32(0.0)
        warp_totals = cuda.shared.array(32, float32)
        total = float32(0.0)
        for j in range(ITEMS):
            total += x[j] * x[j]
        total = warp_sum(total)
        if tid % 32 == 0:
            warp_totals[tid // 32] = total
        cuda.syncthreads()
        lane = tid % 32
        total = warp_totals[lane] if lane < warps else float32(0.0)
        total = warp_sum(total)
        scale = float32(1.0) / math.sqrt(total * inv_n + eps32)
        for j in range(ITEMS):
            if WHOLE or tid + j * threads < hidden_size:
                xn[row, tid + j * threads] = x[j] * scale * w[j]

    return rmsnorm


class RmsNorm:
    """RMSNorm for one hidden size, epsilon and block size; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int, eps: float, max_threads: int):
        self.hidden_size = hidden_size
        self.threads = min(max_threads, -(-hidden_size // 32) * 32)
        self.kernel = _rmsnorm_kernel(hidden_size, float(eps), self.threads)

    def launch(self, stream, h, weight, xn) -> None:
        """h float32 [hidden] or [R, hidden], weight float16 [hidden] -> xn float16 of h's shape
        (or [>= R, hidden]: rows 0 .. R - 1 are written)."""
        if h.ndim == 1:  # one token: a one-row view of the same memory
            h, xn = h.reshape(1, self.hidden_size), xn.reshape(1, self.hidden_size)
        launch(self.kernel, h.shape[0], self.threads, stream, (h, weight, xn))


def make_rmsnorm(hidden_size: int, eps: float) -> RmsNorm:
    """The decode RMSNorm: one row, one block of up to 1024 threads."""
    return RmsNorm(hidden_size, eps, DECODE_THREADS)


def make_rmsnorm_rows(hidden_size: int, eps: float) -> RmsNorm:
    """The prefill RMSNorm: R rows, a block of up to 256 threads each."""
    return RmsNorm(hidden_size, eps, PREFILL_THREADS)


def compile_targets() -> list[CompileTarget]:
    """Both block sizes at the 7B hidden size and a tiny one (fewer threads than a block)."""
    signature = types.void(types.float32[:, ::1], types.float16[::1], types.float16[:, ::1])
    return [CompileTarget(f"rmsnorm[hidden={hidden}, threads={threads}]",
                          RmsNorm(hidden, 1e-6, threads).kernel, signature, ("shfl.sync.bfly.b32",))
            for hidden in (3584, 256) for threads in (DECODE_THREADS, PREFILL_THREADS)]
