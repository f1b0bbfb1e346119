"""RMSNorm of R rows of the residual stream: xn[r] = float16(h[r] * rsqrt(mean(h[r]^2) + eps) * weight).

The batched form of kernels/rmsnorm.py for prefill, where `h` is float32 [R, hidden] (one row per
prompt token of the chunk, R = the bucket's rows) and the FP16 output feeds the tensor-core GEMMs
(kernels/gemm_int4.py). Padding rows are normalised too: they are finite (embedding_prefill.py
zeroes them) and whatever they become is never read, and a fixed grid keeps the launch the same
for every chunk of the bucket.

Launch: R blocks of THREADS (256) threads, block r owns row r; thread t owns elements t,
t + 256, ... (14 at hidden 3584). The reduction is the decode kernel's: each thread sums its
squares in float32, `warp_sum` folds each warp, the warp totals meet in shared memory, every warp
folds those itself, so one `syncthreads` suffices. Traffic: R x hidden x (4 + 2 + 2 from L2-hot
weights) bytes; at R = 512 and hidden 3584, 11 MB, a few us at 4.3 TB/s.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32
from numba.core import types

from ..ptx.warp import warp_sum
from . import CompileTarget

MAX_THREADS = 256  # rows are many: several blocks per SM beat one 1024-thread block per row


@functools.cache
def _rmsnorm_rows_kernel(hidden_size: int, eps: float, threads: int):
    warps = threads // 32
    inv_n = np.float32(1.0 / hidden_size)
    eps32 = np.float32(eps)

    @cuda.jit
    def rmsnorm_rows(h, weight, xn):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        warp_totals = cuda.shared.array(32, float32)
        total = float32(0.0)
        for i in range(tid, hidden_size, threads):
            x = h[row, i]
            total += x * x
        total = warp_sum(total)
        if tid % 32 == 0:
            warp_totals[tid // 32] = total
        cuda.syncthreads()
        lane = tid % 32
        total = warp_totals[lane] if lane < warps else float32(0.0)
        total = warp_sum(total)
        scale = float32(1.0) / math.sqrt(total * inv_n + eps32)
        for i in range(tid, hidden_size, threads):
            xn[row, i] = h[row, i] * scale * float32(weight[i])

    return rmsnorm_rows


class RmsNormRows:
    """RMSNorm over rows for one hidden size and epsilon; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int, eps: float):
        self.threads = min(MAX_THREADS, -(-hidden_size // 32) * 32)
        self.kernel = _rmsnorm_rows_kernel(hidden_size, float(eps), self.threads)

    def launch(self, stream, h, weight, xn) -> None:
        """h float32 [R, hidden], weight float16 [hidden] -> xn float16 [>= R, hidden], rows 0 .. R - 1."""
        self.kernel[h.shape[0], self.threads, stream](h, weight, xn)


def make_rmsnorm_rows(hidden_size: int, eps: float) -> RmsNormRows:
    return RmsNormRows(hidden_size, eps)


def compile_targets() -> list[CompileTarget]:
    """The 7B hidden size and a tiny one."""
    signature = types.void(types.float32[:, ::1], types.float16[::1], types.float16[:, ::1])
    return [CompileTarget(f"rmsnorm_rows[hidden={hidden}]", RmsNormRows(hidden, 1e-6).kernel, signature,
                          ("shfl.sync.bfly.b32",))
            for hidden in (3584, 256)]
