"""The two arithmetic paths of the INT4 GEMV (kernels/gemv_int4_kernel.py builds the kernel around
one): how a lane multiplies a 16-byte weight chunk by its activations, and how a block stages the
activations in shared memory first, with or without a fused RMSNorm.

- prmt (default): `prmt.b32` drops two weight bytes into two FP16 halves whose exponent byte is
  0x64, so after one AND each half is 1024 + nibble (low nibbles) or 1024 + 16 * nibble (high);
  one `fma.rn.f16x2` per half2 removes the offset (exactly), one more multiplies by the activation
  pair and accumulates: per 8 weights, 2 prmt + 4 AND + 8 FP16x2 FMA. The FP16 accumulator covers
  one lane's 32 inputs only; it is then multiplied by the group scale and added in FP32.
- dp4a: a small kernel first quantizes x to INT8 per 128-input group
  (kernels/quantize_activation.py); the GEMV then does, per 8 weights, 1 shift + 2 AND + 2
  `dp4a.s32.s32` in exact integer arithmetic, and one FP32 multiply-add per 32 inputs. Its error is
  the INT8 rounding of x (|x - q s| <= s/2, s = max|x| / 127 over the group).

Activations live in shared memory, staged once per block with every copy in flight at once
(prmt: each thread loads all of its pieces of x, or of h and the norm weight, into registers,
then stores them; dp4a: cp.async copies, not re-measured since prmt dropped them): one L2 round
trip. prmt path: chunk c's 16 half2 words sit
at xs[20 c .. 20 c + 15] (64 bytes used of 80), read as four `ld.shared.v4`: a quarter-warp's 8
lanes read 8 chunks 80 bytes apart, which fall in 8 disjoint groups of 4 banks (no conflict; a
64-byte stride would put 4 lanes on one bank group). dp4a path: the quantizer writes the INT8
words already in the order the GEMV reads them, xq[j * K/32 + c], copied as is (32 lanes read 32
consecutive words).

Fused RMSNorm (prmt path): built with norm_weight / norm_eps, the kernel takes the float32
residual stream h instead of x and stages xn = float16(h * rsqrt(mean h^2 + eps) * weight), the
same float32 expression as kernels/rmsnorm.py: each block sums h^2 over all K (from L2, while its
first weight loads are in flight), then converts pairs with `cvt.rn.f16x2.f32` into the layout
above. The dp4a path runs kernels/rmsnorm.py into its own float16 workspace first.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..config import GROUP_SIZE
from ..ptx.dp4a import dp4a
from ..ptx.half2 import float2_to_half2, fma_f16x2, half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group, ld_shared_v4_u32
from ..ptx.warp import warp_sum
from .int4_unpack import unpack8

CHUNKS_PER_GROUP = GROUP_SIZE // 32  # 16-byte weight chunks (32 inputs) sharing one scale
CHUNK_STRIDE = 20  # shared words between consecutive chunks' activations on the prmt path (16 used)


# The dp4a unpack: the four low nibbles, or (after >> 4) the four high ones, as bytes.
NIBBLE_BYTES = np.uint32(0x0F0F0F0F)


@cuda.jit(device=True, inline="always")
def dot8_prmt(word, x01, x23, x45, x67, acc):
    """acc + (w0 x0 + w2 x2 + w4 x4 + w6 x6, w1 x1 + w3 x3 + w5 x5 + w7 x7) in half2.

    `word` holds weights w0..w7 (nibbles u = w + 8, ValueShuffle); x01 .. x67 are the half2 pairs
    (x0, x1) .. (x6, x7). The unpack (int4_unpack.py) is exact; only the accumulating FMAs round.
    """
    w01, w23, w45, w67 = unpack8(word)
    acc = fma_f16x2(w01, x01, acc)
    acc = fma_f16x2(w23, x23, acc)
    acc = fma_f16x2(w45, x45, acc)
    acc = fma_f16x2(w67, x67, acc)
    return acc


# What one path contributes to a kernel: the shared-memory words it stages activations into;
# stage(activations, xs) (ends with syncthreads); load_x(xs, c, xv), chunk c's activation words
# into the local array xv; and multiply(words, w0, scl, s0, c, activations, xv, acc, a0), which
# adds chunk c of R rows (their words at words[w0 + 4r ..], their scales at scl[s0 + r]) times x
# into acc[a0 + r]. `activations` is a tuple: (x_pairs,) on the prmt path, (h, norm weight pairs)
# with a fused norm, (xq, x_scale, x_offset) on the dp4a path.
#
# Index arithmetic is uint32 throughout, constants included: Numba computes a signed index in
# int64 and guards every array access against Python's negative indices (a compare and a select
# each), which was 30 of the 383 PTX instructions of the prmt loop at 4 rows per warp.
GemvPath = collections.namedtuple("GemvPath", "shared_words stage load_x multiply")
U = np.uint32  # to spell unsigned constants in kernels


@functools.cache
def _prmt_path(k: int, rows: int, threads: int, norm_eps: float | None = None) -> GemvPath:
    """The prmt path; with norm_eps, x is RMSNorm(h) * weight, computed while staging (below)."""
    quads = U(k // 8)  # 16-byte pieces of x: quad q = half2 words 4q .. 4q+3 = words 4(q%4).. of chunk q//4
    warps = threads // 32

    quads_per_thread = -(-(k // 8) // threads)
    values_per_thread, quad_words_per_thread = 8 * quads_per_thread, 4 * quads_per_thread

    @cuda.jit(device=True, inline="always")
    def quad_slot(q):
        return U(CHUNK_STRIDE) * (q // U(4)) + U(4) * (q % U(4))

    @cuda.jit(device=True, inline="always")
    def stage_x(activations, xs):
        # Each thread loads all of its quads of x into registers first (one L2 round trip for the
        # block), then stores them. The cp.async copy this replaced cost the whole kernel 20%
        # (down_proj 17.3 against 13.9 us, o_proj 5.8 against 4.7, lm_head-sized 112 against 78;
        # why is not profiled): docs/PERFORMANCE.md, 2026-12-02 morning.
        x_pairs = activations[0]
        t = U(cuda.threadIdx.x)
        pairs = cuda.local.array(quad_words_per_thread, uint32)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            if q < quads:
                for e in range(4):
                    pairs[4 * j + e] = x_pairs[U(4) * q + U(e)]
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            if q < quads:
                at = quad_slot(q)
                for e in range(4):
                    xs[at + U(e)] = pairs[4 * j + e]
        cuda.syncthreads()

    inv_k = np.float32(1.0 / k)
    eps = np.float32(0.0 if norm_eps is None else norm_eps)

    @cuda.jit(device=True, inline="always")
    def stage_normed(activations, xs):
        # The RMSNorm that used to be its own kernel: every block sums h^2 itself (K float32 from
        # L2), then writes xn = h * rsqrt(mean h^2 + eps) * weight into the same layout as stage_x.
        # Each thread loads all of its quads of h and of the weight first (one L2 round trip),
        # keeps them in registers across the block reduction, then converts and stores them.
        h, weight_pairs = activations
        warp_totals = cuda.shared.array(32, float32)
        t = U(cuda.threadIdx.x)
        values = cuda.local.array(values_per_thread, float32)
        weights = cuda.local.array(quad_words_per_thread, uint32)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            if q < quads:
                for e in range(8):
                    values[8 * j + e] = h[U(8) * q + U(e)]
                weights[4 * j], weights[4 * j + 1], weights[4 * j + 2], weights[4 * j + 3] = \
                    ld_global_nc_v4_u32(weight_pairs, U(4) * q)
        total = float32(0)
        for j in range(quads_per_thread):
            if t + U(j * threads) < quads:
                for e in range(8):
                    total += values[8 * j + e] * values[8 * j + e]
        total = warp_sum(total)
        if t % U(32) == U(0):
            warp_totals[t // U(32)] = total
        cuda.syncthreads()
        total = float32(0)
        for w in range(warps):
            total += warp_totals[w]
        scale = float32(1) / math.sqrt(total * inv_k + eps)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            if q < quads:
                at = quad_slot(q)
                for e in range(4):
                    w0, w1 = half2_to_float2(weights[4 * j + e])
                    xs[at + U(e)] = float2_to_half2(values[8 * j + 2 * e] * scale * w0,
                                                    values[8 * j + 2 * e + 1] * scale * w1)
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def load_x(xs, c, xv):
        for j in range(4):
            xv[4 * j], xv[4 * j + 1], xv[4 * j + 2], xv[4 * j + 3] = \
                ld_shared_v4_u32(xs, U(CHUNK_STRIDE) * c + U(4 * j))

    @cuda.jit(device=True, inline="always")
    def multiply(words, w0, scl, s0, c, activations, xv, acc, a0):
        for r in range(rows):
            h = U(0)  # half2 (0, 0)
            for w in range(4):
                h = dot8_prmt(words[w0 + 4 * r + w], xv[4 * w], xv[4 * w + 1], xv[4 * w + 2], xv[4 * w + 3], h)
            lo, hi = half2_to_float2(h)
            acc[a0 + r] += float32(scl[s0 + r]) * (lo + hi)

    return GemvPath(CHUNK_STRIDE * (k // 32), stage_x if norm_eps is None else stage_normed, load_x, multiply)


@functools.cache
def _dp4a_path(k: int, rows: int, threads: int) -> GemvPath:
    chunks = U(k // 32)
    quads = U(k // 16)  # 16-byte pieces of xq

    @cuda.jit(device=True, inline="always")
    def stage(activations, xs):
        xq = activations[0]
        q = U(cuda.threadIdx.x)
        while q < quads:  # the quantizer wrote xq in the order the GEMV reads it: a plain copy
            cp_async_16(xs, U(4) * q, xq, U(4) * q, U(16))
            q += U(threads)
        cp_async_commit_group()
        cp_async_wait_group(0)
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def load_x(xs, c, xv):
        for j in range(8):
            xv[j] = xs[U(j) * chunks + c]

    @cuda.jit(device=True, inline="always")
    def multiply(words, w0, scl, s0, c, activations, xv, acc, a0):
        x_scale = activations[1][c // U(CHUNKS_PER_GROUP)]
        x_offset = activations[2][c]
        for r in range(rows):
            dot = int32(0)
            for w in range(4):
                word = words[w0 + 4 * r + w]
                dot = dp4a(word & NIBBLE_BYTES, xv[2 * w], dot)
                dot = dp4a((word >> U(4)) & NIBBLE_BYTES, xv[2 * w + 1], dot)
            acc[a0 + r] += float32(scl[s0 + r]) * x_scale * float32(int32(dot - x_offset))

    return GemvPath(k // 4, stage, load_x, multiply)


def gemv_path(path: str, k: int, rows: int, threads: int, norm_eps: float | None = None) -> GemvPath:
    if norm_eps is not None and path != "prmt":
        raise ValueError("only the prmt path fuses RMSNorm into its staging")
    return _prmt_path(k, rows, threads, norm_eps) if path == "prmt" else _dp4a_path(k, rows, threads)
