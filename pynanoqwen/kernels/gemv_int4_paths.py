"""The arithmetic paths of the INT4 GEMV (kernels/gemv_int4_kernel.py builds the kernel around one):
how a lane multiplies a 16-byte weight chunk by its activations, and how a block stages the
activations in shared memory first, with or without a fused RMSNorm. The engine's "auto" takes
fixed16, and prmt for a long K (kernels.kernel_path).

- prmt: `prmt.b32` drops two weight bytes into two FP16 halves whose exponent byte is 0x64, so
  after one AND each half is 1024 + nibble (low nibbles) or 1024 + 16 * nibble (high); one
  `fma.rn.f16x2` per half2 removes the offset (exactly), one more multiplies by the activation pair
  and accumulates: per 8 weights, 2 prmt + 4 AND + 8 FP16x2 FMA. The FP16 accumulator covers one
  lane's 32 inputs only; it is then multiplied by the group scale and added in FP32.
- fixed16: x becomes 16-bit integers v per chunk of 32 inputs (the inputs one lane's 16-byte
  weight chunk covers), v = round(x * 32767 / max|x|), scale s = max|x| / 32767, when the block
  stages it; each v is split into its unsigned low byte and signed high byte. Per 8 weights: 1
  shift + 2 AND split the word into two words of four nibble bytes, and 4 `dp4a` (.u32.u32 against
  the low bytes, .u32.s32 against the high) sum u * v exactly in two int32; per chunk and row,
  256 high + low - 8 sum(v) = sum (u - 8) v = sum w v, exactly (|sum| <= 32 * 8 * 32767 < 2^24, so
  its float32 is exact too), then one float32 multiply by (weight scale * s) and one add. About
  half prmt's instructions a weight: 79 against 140 PTX in the hot loop of two rows
  (tests/test_kernels_compile.py -s). The price is in the staging, which every block does for all
  of x: per input a max, an FMA and a byte permute, per 8 inputs 2 shuffles, a divide and 4 dp4a.
  The error is the rounding of x alone: v = round(x * inverse) is one rounding (an FMA), and
  |v s - x| <= s/2 + 2^-22 |x| (three float32 roundings in inverse * s: inverse, 1/32767, s), so
  over a chunk a relative L2 error of at most sqrt(32)/65534 + 2^-22 < 2^-13; a fused RMSNorm's xn
  goes in as float32, never rounded to FP16 (oracles.gemv_oracle carries the bound).
- dp4a: a small kernel first quantizes x to INT8 per 128-input group
  (kernels/quantize_activation.py); the GEMV then does, per 8 weights, 1 shift + 2 AND + 2
  `dp4a.s32.s32` in exact integer arithmetic, and one FP32 multiply-add per 32 inputs. Its error is
  the INT8 rounding of x (|x - q s| <= s/2, s = max|x| / 127 over the group). fixed16 does the
  same with twice the dp4a, sixteen bits and no extra launch.

What each reaches, standalone and in the step: docs/PERFORMANCE.md, "Decode, 2026-12-04 night".

Activations live in shared memory, staged once per block with every copy in flight at once
(prmt and fixed16: each thread loads all of its pieces of x, or of h and the norm weight, into
registers, then stores them; dp4a: cp.async copies, not re-measured since prmt dropped them): one
L2 round trip. prmt path: chunk c's 16 half2 words sit at xs[20 c .. 20 c + 15] (64 bytes used of
80), read as four `ld.shared.v4`: a quarter-warp's 8 lanes read 8 chunks 80 bytes apart, which
fall in 8 disjoint groups of 4 banks (no conflict; a 64-byte stride would put 4 lanes on one bank
group). fixed16 path: the same 80-byte records, words 4j .. 4j+3 for weight word j (low bytes of
v at the inputs of weights 0, 1, 4, 5, their high bytes, then the same for 2, 3, 6, 7), word 16
-8 sum(v), word 17 s: five `ld.shared.v4`. dp4a path: the quantizer writes the INT8 words already
in the order the GEMV reads them, xq[j * K/32 + c], copied as is (32 lanes read 32 consecutive
words).

Fused RMSNorm (prmt and fixed16 paths): built with norm_weight / norm_eps, the kernel takes the
float32 residual stream h instead of x and stages xn = h * rsqrt(mean h^2 + eps) * weight, the
same float32 expression as kernels/rmsnorm.py: each block sums h^2 over all K (from L2, while its
first weight loads are in flight), then prmt converts pairs with `cvt.rn.f16x2.f32` into its
layout and fixed16 quantizes the float32 values. The dp4a path runs kernels/rmsnorm.py into its
own float16 workspace first.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..config import GROUP_SIZE
from ..ptx.bits import bits_float, float_bits
from ..ptx.dp4a import dp4a, dp4a_us, dp4a_uu
from ..ptx.fma import fma
from ..ptx.prmt import prmt
from ..ptx.half2 import float2_to_half2, fma_f16x2, half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group, ld_shared_v4_u32
from ..ptx.warp import shfl_xor, warp_sum
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
GemvPath = collections.namedtuple("GemvPath", "shared_words x_words stage load_x multiply")
U = np.uint32  # to spell unsigned constants in kernels


@functools.cache
def _chunk_loader(vectors: int):
    """load_x(xs, c, xv) for the 80-byte chunk records of the prmt and fixed16 paths: the first
    `vectors` 16-byte words of chunk c's record into xv, by `ld.shared.v4`."""

    @cuda.jit(device=True, inline="always")
    def load_x(xs, c, xv):
        for j in range(vectors):
            xv[4 * j], xv[4 * j + 1], xv[4 * j + 2], xv[4 * j + 3] = \
                ld_shared_v4_u32(xs, U(CHUNK_STRIDE) * c + U(4 * j))

    return load_x


@functools.cache
def _normed_activations(k: int, threads: int, norm_eps: float | None):
    """normed(activations, t, values): values[8 j + e] = xn[8 q + e] = h * rsqrt(mean h^2 + eps) *
    weight in float32 for thread t's quads q = t + j threads (0 past the end), the staging layout of
    the prmt and fixed16 paths. Each thread loads all of its quads of h and of the weight first
    (one L2 round trip) and keeps them in registers across the block's sum of h^2, which ends with
    a syncthreads. activations = (h float32 [K], the weight as half2 words)."""
    quads, warps = U(k // 8), threads // 32
    quads_per_thread = -(-(k // 8) // threads)
    quad_words_per_thread = 4 * quads_per_thread
    inv_k = np.float32(1.0 / k)
    eps = np.float32(0.0 if norm_eps is None else norm_eps)

    @cuda.jit(device=True, inline="always")
    def normed(activations, t, values):
        h, weight_pairs = activations
        warp_totals = cuda.shared.array(32, float32)
        weights = cuda.local.array(quad_words_per_thread, uint32)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            for e in range(8):
                values[8 * j + e] = float32(0)
            if q < quads:
                for e in range(8):
                    values[8 * j + e] = h[U(8) * q + U(e)]
                weights[4 * j], weights[4 * j + 1], weights[4 * j + 2], weights[4 * j + 3] = \
                    ld_global_nc_v4_u32(weight_pairs, U(4) * q)
        total = float32(0)
        for j in range(quads_per_thread):
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
            if t + U(j * threads) < quads:
                for e in range(4):
                    w0, w1 = half2_to_float2(weights[4 * j + e])
                    values[8 * j + 2 * e] = values[8 * j + 2 * e] * scale * w0
                    values[8 * j + 2 * e + 1] = values[8 * j + 2 * e + 1] * scale * w1

    return normed


@functools.cache
def _prmt_path(k: int, rows: int, threads: int, norm_eps: float | None = None) -> GemvPath:
    """The prmt path; with norm_eps, x is RMSNorm(h) * weight, computed while staging (below)."""
    quads = U(k // 8)  # 16-byte pieces of x: quad q = half2 words 4q .. 4q+3 = words 4(q%4).. of chunk q//4

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

    normed = _normed_activations(k, threads, norm_eps)

    @cuda.jit(device=True, inline="always")
    def stage_normed(activations, xs):
        # The RMSNorm that used to be its own kernel: every block computes xn itself (h from L2),
        # then converts it to FP16 into the same layout as stage_x.
        t = U(cuda.threadIdx.x)
        values = cuda.local.array(values_per_thread, float32)
        normed(activations, t, values)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            if q < quads:
                at = quad_slot(q)
                for e in range(4):
                    xs[at + U(e)] = float2_to_half2(values[8 * j + 2 * e], values[8 * j + 2 * e + 1])
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def multiply(words, w0, scl, s0, c, activations, xv, acc, a0):
        for r in range(rows):
            h = U(0)  # half2 (0, 0)
            for w in range(4):
                h = dot8_prmt(words[w0 + 4 * r + w], xv[4 * w], xv[4 * w + 1], xv[4 * w + 2], xv[4 * w + 3], h)
            lo, hi = half2_to_float2(h)
            acc[a0 + r] += float32(scl[s0 + r]) * (lo + hi)

    return GemvPath(CHUNK_STRIDE * (k // 32), 16, stage_x if norm_eps is None else stage_normed, _chunk_loader(4),
                    multiply)


# The fixed16 path's activation words (module docstring): prmt selectors that gather bytes of the
# 16-bit integers v0..v7 of one quad.
PAIR_BYTES = np.uint32(0x5140)  # (a, b) -> (a.low, b.low, a.high, b.high)
LOW_BYTES = np.uint32(0x5410)  # (p, p') of two PAIR_BYTES words -> the four low bytes
HIGH_BYTES = np.uint32(0x7632)  # -> the four high bytes
FIXED_MAX = 32767  # a chunk's largest |x| becomes this 16-bit integer
INVERSE_FIXED_MAX = np.float32(1.0 / FIXED_MAX)  # scale = largest * this: a multiply, not a divide
ROUNDER = np.float32(1.5 * 2**23)  # y + ROUNDER, |y| < 2^22, is round(y) + 2^22 in the low 23 bits
ONES = U(0x01010101)  # dp4a against it sums four bytes
OFFSET_WORD, SCALE_WORD = 16, 17  # a chunk's -8 sum(v) and float32 scale, after its 16 byte words


@cuda.jit(device=True, inline="always")
def fixed16_quad(values, first, inverse):
    """One quad of x (values[first .. first + 7], float32) as the fixed16 path stages it: v =
    round(x * inverse) as 16-bit integers in its four words (the low bytes of v at the inputs of
    weights 0, 1, 4, 5 of a weight word, their high bytes, the same for 2, 3, 6, 7), and sum v.
    fma(x, inverse, ROUNDER) rounds x * inverse to an integer once, into the low bits of a float
    whose bytes 0-1 are v as an int16; the sum comes from the packed bytes by dp4a against ones.
    dev/gemv_group.py stages its groups with it too."""
    bits = cuda.local.array(8, uint32)
    for e in range(8):
        bits[e] = float_bits(fma(values[first + e], inverse, ROUNDER))
    a0, a1 = prmt(bits[0], bits[1], PAIR_BYTES), prmt(bits[4], bits[5], PAIR_BYTES)
    b0, b1 = prmt(bits[2], bits[3], PAIR_BYTES), prmt(bits[6], bits[7], PAIR_BYTES)
    a_low, a_high = prmt(a0, a1, LOW_BYTES), prmt(a0, a1, HIGH_BYTES)
    b_low, b_high = prmt(b0, b1, LOW_BYTES), prmt(b0, b1, HIGH_BYTES)
    total = dp4a_uu(a_low, ONES, dp4a_uu(b_low, ONES, 0))
    total = int32(total + int32(256) * dp4a_us(ONES, a_high, dp4a_us(ONES, b_high, 0)))
    return a_low, a_high, b_low, b_high, total


@functools.cache
def _fixed16_path(k: int, rows: int, threads: int, norm_eps: float | None = None) -> GemvPath:
    """The fixed16 path; with norm_eps, x is RMSNorm(h) * weight, computed while staging."""
    quads = U(k // 8)
    quads_per_thread = -(-(k // 8) // threads)
    values_per_thread = 8 * quads_per_thread
    normed = _normed_activations(k, threads, norm_eps)

    @cuda.jit(device=True, inline="always")
    def quantize_and_store(values, t, xs):
        # Thread t holds quads q = t + j threads (values[8 j ..]); the 4 quads of a chunk sit in 4
        # neighbouring lanes, which share the chunk's largest |x| and sum through 2 shuffles. Every
        # lane takes part (a lane past the end holds zeros and stores nothing).
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            largest = float32(0)
            for e in range(8):
                largest = max(largest, abs(values[8 * j + e]))
            largest = max(largest, shfl_xor(largest, 1))
            largest = max(largest, shfl_xor(largest, 2))
            inverse = float32(FIXED_MAX) / largest if largest > float32(0) else float32(0)
            a_low, a_high, b_low, b_high, total = fixed16_quad(values, 8 * j, inverse)
            total = int32(total + shfl_xor(total, 1))
            total = int32(total + shfl_xor(total, 2))
            if q < quads:
                chunk_at = U(CHUNK_STRIDE) * (q // U(4))
                at = chunk_at + U(4) * (q % U(4))
                xs[at] = a_low
                xs[at + U(1)] = a_high
                xs[at + U(2)] = b_low
                xs[at + U(3)] = b_high
                if q % U(4) == U(0):
                    xs[chunk_at + U(OFFSET_WORD)] = uint32(int32(-8) * total)
                    xs[chunk_at + U(SCALE_WORD)] = float_bits(largest * INVERSE_FIXED_MAX)
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def stage_x(activations, xs):
        x_pairs = activations[0]
        t = U(cuda.threadIdx.x)
        values = cuda.local.array(values_per_thread, float32)
        for j in range(quads_per_thread):
            q = t + U(j * threads)
            for e in range(4):
                values[8 * j + 2 * e], values[8 * j + 2 * e + 1] = float32(0), float32(0)
                if q < quads:
                    values[8 * j + 2 * e], values[8 * j + 2 * e + 1] = half2_to_float2(x_pairs[U(4) * q + U(e)])
        quantize_and_store(values, t, xs)

    @cuda.jit(device=True, inline="always")
    def stage_normed(activations, xs):
        # As the prmt path's, but xn stays float32 until it is quantized: no FP16 rounding between.
        t = U(cuda.threadIdx.x)
        values = cuda.local.array(values_per_thread, float32)
        normed(activations, t, values)
        quantize_and_store(values, t, xs)

    @cuda.jit(device=True, inline="always")
    def multiply(words, w0, scl, s0, c, activations, xv, acc, a0):
        x_scale = bits_float(xv[SCALE_WORD])
        for r in range(rows):
            low, high = int32(xv[OFFSET_WORD]), int32(0)
            for w in range(4):
                word = words[w0 + 4 * r + w]
                weights_a = word & NIBBLE_BYTES  # weights 0, 1, 4, 5 of the word's 8
                weights_b = (word >> U(4)) & NIBBLE_BYTES  # weights 2, 3, 6, 7
                low = dp4a_uu(weights_a, xv[4 * w], low)
                high = dp4a_us(weights_a, xv[4 * w + 1], high)
                low = dp4a_uu(weights_b, xv[4 * w + 2], low)
                high = dp4a_us(weights_b, xv[4 * w + 3], high)
            dot = int32(high * int32(256) + low)  # sum (u - 8) v over the chunk, exactly
            acc[a0 + r] += float32(dot) * (float32(scl[s0 + r]) * x_scale)

    return GemvPath(CHUNK_STRIDE * (k // 32), 20, stage_x if norm_eps is None else stage_normed, _chunk_loader(5),
                    multiply)


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

    return GemvPath(k // 4, 8, stage, load_x, multiply)


def gemv_path(path: str, k: int, rows: int, threads: int, norm_eps: float | None = None) -> GemvPath:
    if path == "dp4a":
        if norm_eps is not None:
            raise ValueError("the dp4a path does not fuse RMSNorm into its staging")
        return _dp4a_path(k, rows, threads)
    return (_prmt_path if path == "prmt" else _fixed16_path)(k, rows, threads, norm_eps)
