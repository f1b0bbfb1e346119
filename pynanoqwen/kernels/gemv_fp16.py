"""FP16 GEMV for the lm_head when it is not INT4: logits[n] = sum_k W[n, k] x[k], W float16.

Used when a .nanoqwen file stores an FP16 lm_head (`convert --lm-head fp16`), or when the
lm_head is tied to the FP16 embedding table (then W *is* the engine's embedding buffer, not a
copy). At 7B that is 152064 x 3584 x 2 B = 1.09 GB per token, 3.6x the INT4 lm_head: the kernel
only has to stream it at memory speed, with float32 accumulation.

Launch shape: 256 threads (8 warps) per block, each warp owns R consecutive rows (R = 4 when that
still gives every SM 16 warps, else 2 or 1: `default_rows_per_warp`). Lane L reads 16-byte chunks
c = L, L + 32, ... of its rows (8 weights each, `ld.global.nc.v4.u32`: a warp step reads 512
contiguous bytes per row), unpacks the half2 words to float32 and multiplies by x, staged once
per block in shared memory as float32. Chunk c's inputs 8c .. 8c+7 sit at xs[9c .. 9c+7] (one
pad word per 8): lane L reads bank (9L + j) mod 32, different for all 32 lanes, where the plain
layout would give 8c + j, a 4-way conflict. Lane sums meet in a `warp_sum`; lane r writes row r.

Traffic: N*K*2 bytes of W + K*2 of x per block (L2). `bench` times it for a model with an FP16
lm_head (its kernel table); the runs in docs/PERFORMANCE.md are of 7B files with an INT4 one.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32
from numba.core import types

from ..device import sm_count
from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.half2 import half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.warp import warp_sum
from . import CompileTarget, on_device

WARPS_PER_BLOCK = 8
THREADS_PER_BLOCK = 32 * WARPS_PER_BLOCK
WARPS_PER_SM = 16  # 4 rows per warp only while the matrix still gives every SM 16 warps


def default_rows_per_warp(n: int, sms: int | None = None) -> int:
    """Rows per warp for N rows on a GPU of `sms` SMs (this one's by default)."""
    target = WARPS_PER_SM * (sm_count() if sms is None else sms)
    for rows in (4, 2):
        if n % rows == 0 and n // rows >= target:
            return rows
    return 1


@functools.cache
def gemv_fp16_kernel(n: int, k: int, rows: int):
    """gemv_fp16(weight_words uint32 [N*K/2] (W as half2 words), x float16 [K], out float32 [N])."""
    chunks = k // 8
    words_per_row = k // 2
    padded_k = k + k // 8  # one pad float per 8 inputs
    words_in_flight = 4 * rows

    @cuda.jit
    def gemv_fp16(weight_words, x, out):
        xs = cuda.shared.array(padded_k, float32)
        launch_dependents()
        grid_dependency_wait()  # x is the previous kernel's output (launch.py)
        for e in range(cuda.threadIdx.x, k, THREADS_PER_BLOCK):
            xs[e + e // 8] = float32(x[e])
        cuda.syncthreads()
        lane = cuda.laneid
        row0 = (cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // 32) * rows
        if row0 >= n:
            return
        acc = cuda.local.array(rows, float32)
        words = cuda.local.array(words_in_flight, uint32)
        for r in range(rows):
            acc[r] = float32(0)
        for c in range(lane, chunks, 32):
            for r in range(rows):  # all R loads first: they are in flight together
                words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = ld_global_nc_v4_u32(
                    weight_words, (row0 + r) * words_per_row + 4 * c)
            for r in range(rows):
                for w in range(4):
                    w_even, w_odd = half2_to_float2(words[4 * r + w])
                    acc[r] += w_even * xs[9 * c + 2 * w] + w_odd * xs[9 * c + 2 * w + 1]
        for r in range(rows):
            total = warp_sum(acc[r])
            if lane == r:
                out[row0 + r] = total

    return gemv_fp16


class Fp16Gemv:
    """out float32 [N] = W x for one FP16 matrix W [N, K]; built by make_gemv_fp16."""

    def __init__(self, n: int, k: int, weight, *, rows_per_warp: int | None = None):
        if k % 8:
            raise ValueError(f"K={k} must be a multiple of 8 (16-byte rows chunks)")
        if tuple(weight.shape) != (n, k) or weight.dtype != np.float16:
            raise ValueError(f"weight must be float16 [{n}, {k}], got {weight.dtype} {tuple(weight.shape)}")
        rows = default_rows_per_warp(n) if rows_per_warp is None else rows_per_warp
        if rows not in (1, 2, 4) or n % rows:
            raise ValueError(f"rows_per_warp={rows} must be 1, 2 or 4 and divide N={n}")
        weight = on_device(weight, np.float16)
        self.n, self.k, self.rows_per_warp = n, k, rows
        self.weight_words = weight.reshape(n * k).view(np.uint32)
        self.kernel = gemv_fp16_kernel(n, k, rows)
        self.grid = -(-n // (rows * WARPS_PER_BLOCK))

    def launch(self, stream, x, out) -> None:
        """out[N] = W x; x float16 [K], out float32 [N], both on the device."""
        launch(self.kernel, self.grid, THREADS_PER_BLOCK, stream, (self.weight_words, x, out))


def make_gemv_fp16(n: int, k: int, weight, *, rows_per_warp: int | None = None) -> Fp16Gemv:
    """An FP16 GEMV for W [n, k] (a numpy array, copied, or a device array, used in place)."""
    return Fp16Gemv(n, k, weight, rows_per_warp=rows_per_warp)


def fp16_gemv_bytes(n: int, k: int) -> int:
    """Bytes one call must read: W once and x once."""
    return 2 * n * k + 2 * k


def compile_targets() -> list[CompileTarget]:
    """The 7B and 0.5B-tied lm_head shapes and a tiny one."""
    signature = types.void(types.uint32[::1], types.float16[::1], types.float32[::1])
    return [CompileTarget(f"gemv_fp16[{name} {n}x{k}]", gemv_fp16_kernel(n, k, default_rows_per_warp(n, 132)),
                          signature, ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32"))
            for name, n, k in (("lm_head 7b", 152064, 3584), ("lm_head 0.5b", 151936, 896),
                               ("tiny", 64, 256))]
