"""RMSNorm of the residual stream: xn = float16(h * rsqrt(mean(h^2) + eps) * weight).

Runs before every QKV, gate-up and lm_head GEMV, unless the GEMV applies the norm itself (the
engine's default on the prmt path: kernels/gemv_int4.py, norm_weight=); then it runs only for
the FP16 lm_head and on the dp4a path, inside the GEMV object. The residual adds themselves happen in the
epilogues of the o_proj and down_proj GEMVs (they accumulate into `h`), so this kernel only reads
the float32 stream `h` and writes the FP16 activation the next GEMV reads (docs/DECODE.md).

Launch: one block of min(1024, hidden rounded up to a warp) threads; thread t owns elements
t, t + threads, ... . Each thread sums its squares in float32, `warp_sum` folds each warp, the
warp totals meet in shared memory, and then every warp folds those totals itself, so all threads
learn the sum after a single `syncthreads`. Then each thread scales and writes its elements.
Traffic: hidden * (4 + 2 + 2) bytes, 28 KiB at hidden 3584; like the embedding, the kernel is
latency, not bandwidth. The float32 sum of squares is accurate to ~1e-6 relative at these sizes,
well under the FP16 rounding of the output. Measured: not yet (scripts/gpu_check.py times it).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32
from numba.core import types

from ..ptx.warp import warp_sum
from . import CompileTarget

MAX_THREADS = 1024


@functools.cache
def _rmsnorm_kernel(hidden_size: int, eps: float, threads: int):
    warps = threads // 32
    inv_n = np.float32(1.0 / hidden_size)
    eps32 = np.float32(eps)

    @cuda.jit
    def rmsnorm(h, weight, xn):
        tid = cuda.threadIdx.x
        warp_totals = cuda.shared.array(32, float32)
        total = float32(0.0)
        for i in range(tid, hidden_size, threads):
            x = h[i]
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
            xn[i] = h[i] * scale * float32(weight[i])

    return rmsnorm


class RmsNorm:
    """RMSNorm for one hidden size and epsilon; `launch` enqueues it on a stream."""

    def __init__(self, hidden_size: int, eps: float):
        self.threads = min(MAX_THREADS, -(-hidden_size // 32) * 32)
        self.kernel = _rmsnorm_kernel(hidden_size, float(eps), self.threads)

    def launch(self, stream, h, weight, xn) -> None:
        """h float32 [hidden], weight float16 [hidden] -> xn float16 [hidden]."""
        self.kernel[1, self.threads, stream](h, weight, xn)


def make_rmsnorm(hidden_size: int, eps: float) -> RmsNorm:
    return RmsNorm(hidden_size, eps)


def compile_targets() -> list[CompileTarget]:
    """The 7B hidden size and a tiny one (fewer threads than 1024)."""
    signature = types.void(types.float32[::1], types.float16[::1], types.float16[::1])
    return [CompileTarget(f"rmsnorm[hidden={hidden}]", RmsNorm(hidden, 1e-6).kernel, signature,
                          ("shfl.sync.bfly.b32",))
            for hidden in (3584, 256)]
