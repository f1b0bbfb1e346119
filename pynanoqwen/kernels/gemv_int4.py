"""INT4 GEMV for one token: out[n] = sum_k W[n, k] x[k], plus a fused epilogue.

W is an INT4 linear in the ValueShuffle layout of pynanoqwen/quant.py: qweight uint32 [N, K/8]
(row n's K/8 words contiguous), scales float16 [N, K/128]. x is float16 [K]. At batch 1 every
weight byte is used once, so the kernel's job is to stream qweight at memory speed (~4.3 TB/s on
the H200) while doing as little arithmetic per weight as possible. Two real paths read the same
layout; `--gemv prmt|dp4a` picks one and the benchmark settles which wins on Hopper:

- prmt (default): `prmt.b32` drops two weight bytes into two FP16 halves whose exponent byte is
  0x64, so after one AND each half is 1024 + nibble (low nibbles) or 1024 + 16 * nibble (high);
  one `fma.rn.f16x2` per half2 removes the offset (exactly), one more multiplies by the activation
  pair and accumulates: per 8 weights, 2 prmt + 4 AND + 8 FP16x2 FMA. The FP16 accumulator covers
  one lane's 32 inputs only; it is then multiplied by the group scale and added in FP32.
- dp4a: a small kernel first quantizes x to INT8 per 128-input group
  (kernels/quantize_activation.py); the GEMV then does, per 8 weights, 1 shift + 2 AND + 2
  `dp4a.s32.s32` in exact integer arithmetic, and one FP32 multiply-add per 32 inputs. Its error is
  the INT8 rounding of x (|x - q s| <= s/2, s = max|x| / 127 over the group).

Launch shape: 256 threads (8 warps) per block, one block per 8 * R rows. Each warp owns R
consecutive rows (R = rows_per_warp, 1, 2 or 4); lane L handles 16-byte chunks c = L, L + 32, ...
of those rows (chunk c = inputs 32c .. 32c+31 = words 4c .. 4c+3 of a row), so one step of the
warp reads 512 contiguous bytes of each of its R rows (coalesced, R 16-byte loads in flight per
lane) and the activations it loads from shared memory serve R rows. The group scale of chunk c is
scales[n, c // 4]. Lane partial sums meet in a warp_sum; lane r stores row r (epilogue).

Activations live in shared memory, staged once per block, laid out so that the 32 lanes' reads of
one step hit 32 different banks (the 331 GB/s GEMV probe of docs/HARDWARE.md had a 32-way
conflict): prmt path: half2 word i (0..15) of chunk c sits at xs[i * xs_stride + c]; dp4a path: the
quantizer writes the INT8 words already in that order, xq[j * K/32 + c], copied as is.
xs_stride = K/32 rounded up to 2 mod 8 also keeps the staging stores (one 16-byte load of x per
thread, scattered to 4 rows of the layout) free of conflicts.

Memory traffic per call (`gemv_bytes`): N*K/2 bytes of qweight + N*K/64 of scales + 2K of x
(each block re-reads x, from L2). At the H200's ~4.3 TB/s that is, for the 7B shapes:
qkv 4608x3584 8.5 MB 2.0 us, o_proj 3584x3584 6.6 MB 1.5 us, gate+up 2 x 18944x3584 70.0 MB
16.3 us, down 3584x18944 35.0 MB 8.2 us, INT4 lm_head 152064x3584 281 MB 65 us; per decode step
(28 layers + lm_head) 3.65 GB, 0.85 ms: ~1180 tokens/s is the GEMVs' ceiling. Measured: not yet
(tests/test_gemv_gpu.py prints GB/s per shape, path and rows per warp).

Fused RMSNorm (prmt path): built with norm_weight / norm_eps, the kernel takes the float32
residual stream h instead of x and stages xn = float16(h * rsqrt(mean h^2 + eps) * weight), the
same float32 expression as kernels/rmsnorm.py: each block sums h^2 over all K (14 KiB from L2 at
K 3584, while its first weight loads are in flight; warp_sum + one syncthreads), then converts
pairs with `cvt.rn.f16x2.f32` into the layout above. That removes the separate norm launch
(3.27 us each, 57 a step, measured) for ~0.3-0.5 us more per fused GEMV (predicted, not yet
measured): ~150 us a step. The dp4a path runs kernels/rmsnorm.py into its own float16
workspace first (same launches as before).

API (the engine builds these once per layer, at load):

    gemv = make_gemv_int4(n, k, qweight, scales, path="prmt", bias=None, out_dtype="float32")
    gemv.launch(stream, x, out)                  # out[N] = W x (+ bias); x float16 [K]
    gemv.launch(stream, x, h, residual=True)     # h[N] += W x (o_proj, down_proj)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path="prmt")
    mlp.launch(stream, x, out)                   # out float16 [N] = silu(Wg x) * (Wu x)
    qkv = make_gemv_int4(..., norm_weight=w, norm_eps=eps)
    qkv.launch(stream, h, out)                   # x = RMSNorm(h) * w, h float32 [K]

Weights and bias (float16 [N]) may be numpy arrays (copied to the device once) or device arrays
(used in place). Both factories take `rows_per_warp=` (default: `default_rows_per_warp(n)`). On the
dp4a path each object owns its INT8 workspace and `launch` runs two kernels, quantizer then GEMV.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32
from numba.core import types

from ..config import GROUP_SIZE
from ..ptx.dp4a import dp4a
from ..ptx.half2 import float2_to_half2, fma_f16x2, half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.warp import warp_sum
from . import CompileTarget, on_device
from .int4_unpack import unpack8
from .quantize_activation import Int8Activations
from .rmsnorm import make_rmsnorm

PATHS = ("prmt", "dp4a")
WARPS_PER_BLOCK = 8
THREADS_PER_BLOCK = 32 * WARPS_PER_BLOCK
CHUNKS_PER_GROUP = GROUP_SIZE // 32  # 16-byte weight chunks (32 inputs) sharing one scale

# Rows per warp: 4 (2 per matrix for gate/up) when the matrix still gives every SM of an H200
# (132) at least 16 warps that way, else fewer: more rows mean more loads in flight per lane and
# fewer shared-memory reads per weight, fewer rows mean more warps for small matrices.
TARGET_WARPS = 132 * 16
MAX_LOADS_PER_STEP = 4  # rows x matrices; gate/up at 2 x 4 rows took 128 registers


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


# What one path contributes to a kernel: the shared-memory words it stages activations into,
# stage(activations, xs) (ends with syncthreads), and multiply(words, scales, row0, c, activations,
# xs, acc), which adds chunk c of rows row0 .. row0+R-1 (already loaded into words[4r .. 4r+3] by
# load_rows) times x into acc[0 .. R-1]. `activations` is a tuple: (x_pairs,) on the prmt path,
# (xq, x_scale, x_offset) on the dp4a path.
#
# Index arithmetic is uint32 throughout, constants included: Numba computes a signed index in
# int64 and guards every array access against Python's negative indices (a compare and a select
# each), which was 30 of the 383 PTX instructions of the prmt loop at 4 rows per warp.
_Path = collections.namedtuple("_Path", "shared_words stage multiply")
U = np.uint32  # to spell unsigned constants in kernels


@functools.cache
def _load_rows(k: int, rows: int):
    words_per_row = U(k // 8)

    @cuda.jit(device=True, inline="always")
    def load_rows(qweight, row0, c, words):
        """Chunk c (16 bytes) of rows row0 .. row0+R-1 into words[4r .. 4r+3]: R loads in flight."""
        for r in range(rows):
            words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = ld_global_nc_v4_u32(
                qweight, (row0 + U(r)) * words_per_row + U(4) * c)

    return load_rows


@functools.cache
def _prmt_path(k: int, rows: int, norm_eps: float | None = None) -> _Path:
    """The prmt path; with norm_eps, x is RMSNorm(h) * weight, computed while staging (below)."""
    xs_stride = U(k // 32 + (2 - k // 32) % 8)
    groups = U(k // GROUP_SIZE)
    quads = U(k // 8)  # 16-byte pieces of x

    @cuda.jit(device=True, inline="always")
    def stage_x(activations, xs):
        x_pairs = activations[0]
        q = U(cuda.threadIdx.x)
        while q < quads:  # quad q = half2 words 4q .. 4q+3 = words 4(q%4) .. of chunk q//4
            p0, p1, p2, p3 = ld_global_nc_v4_u32(x_pairs, U(4) * q)
            at = U(4) * (q % U(4)) * xs_stride + q // U(4)
            xs[at] = p0
            xs[at + xs_stride] = p1
            xs[at + U(2) * xs_stride] = p2
            xs[at + U(3) * xs_stride] = p3
            q += U(THREADS_PER_BLOCK)
        cuda.syncthreads()

    inv_k = np.float32(1.0 / k)
    eps = np.float32(0.0 if norm_eps is None else norm_eps)

    @cuda.jit(device=True, inline="always")
    def normed_pair(h, i, scale, weight_pair):
        """The half2 (xn[i], xn[i+1]), xn = float16(h * scale * weight) exactly as kernels/rmsnorm.py."""
        w0, w1 = half2_to_float2(weight_pair)
        return float2_to_half2(h[i] * scale * w0, h[i + U(1)] * scale * w1)

    @cuda.jit(device=True, inline="always")
    def stage_normed(activations, xs):
        # The RMSNorm that used to be its own kernel (3.3 us a launch, 57 launches a step): every
        # block sums h^2 itself (K float32 from L2, while its first weights are in flight), then
        # writes xn = h * rsqrt(mean h^2 + eps) * weight into the same layout as stage_x.
        h, weight_pairs = activations
        warp_totals = cuda.shared.array(WARPS_PER_BLOCK, float32)
        t = U(cuda.threadIdx.x)
        total = float32(0)
        i = t
        while i < U(k):
            total += h[i] * h[i]
            i += U(THREADS_PER_BLOCK)
        total = warp_sum(total)
        if t % U(32) == U(0):
            warp_totals[t // U(32)] = total
        cuda.syncthreads()
        total = float32(0)
        for w in range(WARPS_PER_BLOCK):
            total += warp_totals[w]
        scale = float32(1) / math.sqrt(total * inv_k + eps)
        q = t
        while q < quads:  # quad q = inputs 8q .. 8q+7, as in stage_x
            w0, w1, w2, w3 = ld_global_nc_v4_u32(weight_pairs, U(4) * q)
            at = U(4) * (q % U(4)) * xs_stride + q // U(4)
            xs[at] = normed_pair(h, U(8) * q, scale, w0)
            xs[at + xs_stride] = normed_pair(h, U(8) * q + U(2), scale, w1)
            xs[at + U(2) * xs_stride] = normed_pair(h, U(8) * q + U(4), scale, w2)
            xs[at + U(3) * xs_stride] = normed_pair(h, U(8) * q + U(6), scale, w3)
            q += U(THREADS_PER_BLOCK)
        cuda.syncthreads()

    stage = stage_x if norm_eps is None else stage_normed

    @cuda.jit(device=True, inline="always")
    def multiply(words, scales, row0, c, activations, xs, acc):
        for r in range(rows):
            h = U(0)  # half2 (0, 0)
            for w in range(4):
                x = U(4 * w) * xs_stride + c
                h = dot8_prmt(words[4 * r + w], xs[x], xs[x + xs_stride], xs[x + U(2) * xs_stride],
                              xs[x + U(3) * xs_stride], h)
            lo, hi = half2_to_float2(h)
            acc[r] += float32(scales[(row0 + U(r)) * groups + c // U(CHUNKS_PER_GROUP)]) * (lo + hi)

    return _Path(16 * int(xs_stride), stage, multiply)


@functools.cache
def _dp4a_path(k: int, rows: int) -> _Path:
    chunks = U(k // 32)
    groups = U(k // GROUP_SIZE)
    quads = U(k // 16)  # 16-byte pieces of xq

    @cuda.jit(device=True, inline="always")
    def stage(activations, xs):
        xq = activations[0]
        q = U(cuda.threadIdx.x)
        while q < quads:  # the quantizer wrote xq in the order the GEMV reads it: a plain copy
            xs[U(4) * q], xs[U(4) * q + U(1)], xs[U(4) * q + U(2)], xs[U(4) * q + U(3)] = \
                ld_global_nc_v4_u32(xq, U(4) * q)
            q += U(THREADS_PER_BLOCK)
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def multiply(words, scales, row0, c, activations, xs, acc):
        x_scale = activations[1][c // U(CHUNKS_PER_GROUP)]
        x_offset = activations[2][c]
        for r in range(rows):
            dot = int32(0)
            for w in range(4):
                word = words[4 * r + w]
                dot = dp4a(word & NIBBLE_BYTES, xs[U(2 * w) * chunks + c], dot)
                dot = dp4a((word >> U(4)) & NIBBLE_BYTES, xs[U(2 * w + 1) * chunks + c], dot)
            weight_scale = float32(scales[(row0 + U(r)) * groups + c // U(CHUNKS_PER_GROUP)])
            acc[r] += weight_scale * x_scale * float32(int32(dot - x_offset))

    return _Path(k // 4, stage, multiply)


def _path(path: str, k: int, rows: int, norm_eps: float | None = None) -> _Path:
    if norm_eps is not None and path != "prmt":
        raise ValueError("only the prmt path fuses RMSNorm into its staging")
    return _prmt_path(k, rows, norm_eps) if path == "prmt" else _dp4a_path(k, rows)


@cuda.jit(device=True, inline="always")
def first_row(rows):
    """First of the `rows` consecutive rows this thread's warp owns."""
    warp = U(cuda.blockIdx.x) * U(WARPS_PER_BLOCK) + U(cuda.threadIdx.x) // U(32)
    return warp * U(rows)


# Both kernels below run the same pipeline per warp: the weights of the lane's first chunk are
# requested before the block stages x (their latency hides the staging), and in every step the
# next chunk's weights are requested before this chunk's arithmetic, so each lane keeps R
# 16-byte loads in flight the whole time. `current[i] = upcoming[i]` is register renaming once
# the loops are unrolled (ptxas reports no local memory).


@functools.cache
def gemv_kernel(path: str, n: int, k: int, rows: int, bias: bool, residual: bool,
                norm_eps: float | None = None):
    """gemv_int4(qweight, scales, activations, bias, out) for one shape, path and epilogue.

    qweight uint32 [N*K/8] and scales float16 [N*K/128] are flat; `bias` (float16 [N]) is read
    only when bias=True (pass any float16 array otherwise); out is float32 or float16 [N].
    With norm_eps (prmt only), activations is (h float32 [K], norm weight as uint32 [K/2]).
    """
    shared_words, stage, multiply = _path(path, k, rows, norm_eps)
    load_rows = _load_rows(k, rows)
    chunks = U(k // 32)
    words_in_flight = 4 * rows

    @cuda.jit
    def gemv_int4(qweight, scales, activations, bias_values, out):
        xs = cuda.shared.array(shared_words, uint32)
        current = cuda.local.array(words_in_flight, uint32)
        upcoming = cuda.local.array(words_in_flight, uint32)
        row0 = first_row(rows)
        lane = U(cuda.laneid)
        if row0 < n and lane < chunks:
            load_rows(qweight, row0, lane, current)
        stage(activations, xs)
        if row0 >= n:
            return
        acc = cuda.local.array(rows, float32)
        for r in range(rows):
            acc[r] = float32(0)
        c = lane
        while c < chunks:
            if c + U(32) < chunks:
                load_rows(qweight, row0, c + U(32), upcoming)
            multiply(current, scales, row0, c, activations, xs, acc)
            for i in range(words_in_flight):
                current[i] = upcoming[i]
            c += U(32)
        for r in range(rows):
            total = warp_sum(acc[r])
            if lane == r:  # lane r stores row r: the R stores go out together
                if bias:
                    total += float32(bias_values[row0 + U(r)])
                if residual:
                    out[row0 + U(r)] += total
                else:
                    out[row0 + U(r)] = total

    return gemv_int4


@functools.cache
def gate_up_kernel(path: str, n: int, k: int, rows: int, norm_eps: float | None = None):
    """gate_up_silu(gate_q, gate_s, up_q, up_s, activations, out): out f16 = silu(Wg x) * (Wu x)."""
    shared_words, stage, multiply = _path(path, k, rows, norm_eps)
    load_rows = _load_rows(k, rows)
    chunks = U(k // 32)
    words_in_flight = 4 * rows

    @cuda.jit
    def gate_up_silu(gate_q, gate_s, up_q, up_s, activations, out):
        xs = cuda.shared.array(shared_words, uint32)
        gate_current = cuda.local.array(words_in_flight, uint32)
        gate_upcoming = cuda.local.array(words_in_flight, uint32)
        up_current = cuda.local.array(words_in_flight, uint32)
        up_upcoming = cuda.local.array(words_in_flight, uint32)
        row0 = first_row(rows)
        lane = U(cuda.laneid)
        if row0 < n and lane < chunks:
            load_rows(gate_q, row0, lane, gate_current)
            load_rows(up_q, row0, lane, up_current)
        stage(activations, xs)
        if row0 >= n:
            return
        gate = cuda.local.array(rows, float32)
        up = cuda.local.array(rows, float32)
        for r in range(rows):
            gate[r] = float32(0)
            up[r] = float32(0)
        c = lane
        while c < chunks:
            if c + U(32) < chunks:
                load_rows(gate_q, row0, c + U(32), gate_upcoming)
                load_rows(up_q, row0, c + U(32), up_upcoming)
            multiply(gate_current, gate_s, row0, c, activations, xs, gate)
            multiply(up_current, up_s, row0, c, activations, xs, up)
            for i in range(words_in_flight):
                gate_current[i] = gate_upcoming[i]
                up_current[i] = up_upcoming[i]
            c += U(32)
        for r in range(rows):
            g = warp_sum(gate[r])
            u = warp_sum(up[r])
            if lane == r:
                out[row0 + U(r)] = g / (float32(1) + math.exp(-g)) * u

    return gate_up_silu


def default_rows_per_warp(n: int, matrices: int = 1) -> int:
    for rows in (4, 2):
        if rows * matrices <= MAX_LOADS_PER_STEP and n % rows == 0 and n // rows >= TARGET_WARPS:
            return rows
    return 1


def _check(path: str, n: int, k: int, qweight, scales, rows: int) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown GEMV path {path!r}; choose one of {PATHS}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    if tuple(qweight.shape) != (n, k // 8) or tuple(scales.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not match "
                         f"N={n}, K={k}")
    if rows not in (1, 2, 4) or n % rows:
        raise ValueError(f"rows_per_warp={rows} must be 1, 2 or 4 and divide N={n}")


class _Launcher:
    """What both GEMV objects share: the grid, the dp4a path's INT8 workspace, the activations.

    With a norm (weight float16 [K], eps) the input is the float32 residual stream h and the GEMV
    reads x = RMSNorm(h) * weight: the prmt kernel computes it while staging (one launch); the
    dp4a path runs kernels/rmsnorm.py into its own float16 workspace, then quantizes that.
    """

    def __init__(self, path: str, n: int, k: int, rows: int, norm_weight=None, norm_eps=None):
        if (norm_weight is None) != (norm_eps is None):
            raise ValueError("norm_weight and norm_eps go together")
        self.path, self.n, self.k, self.rows = path, n, k, rows
        self.grid = -(-n // (rows * WARPS_PER_BLOCK))
        self.int8 = Int8Activations(k) if path == "dp4a" else None
        self.norm_eps = None if norm_eps is None else float(norm_eps)
        self.norm_weight = None if norm_weight is None else on_device(norm_weight, np.float16)
        if self.norm_weight is not None and tuple(self.norm_weight.shape) != (k,):
            raise ValueError(f"norm_weight must have shape ({k},), got {tuple(self.norm_weight.shape)}")
        if self.norm_weight is not None and path == "dp4a":
            self.rmsnorm = make_rmsnorm(k, self.norm_eps)
            self.xn = cuda.device_array(k, np.float16)

    @property
    def kernel_norm_eps(self):
        """The eps the kernel itself is built with: only the prmt path fuses the norm."""
        return self.norm_eps if self.path == "prmt" else None

    def activations(self, stream, x):
        """The kernel's `activations` tuple for x: float16 [K], or with a norm float32 h [K]
        (normalised first on dp4a); quantizes on dp4a."""
        dtype = np.float16 if self.norm_weight is None else np.float32
        if tuple(x.shape) != (self.k,) or x.dtype != dtype:
            raise ValueError(f"x must be {np.dtype(dtype)} [{self.k}], got {x.dtype} {tuple(x.shape)}")
        if self.norm_weight is not None:
            if self.int8 is None:
                return (x, self.norm_weight.view(np.uint32))
            self.rmsnorm.launch(stream, x, self.norm_weight, self.xn)
            x = self.xn
        x_pairs = x.view(np.uint32)
        if self.int8 is None:
            return (x_pairs,)
        self.int8.launch(stream, x_pairs)
        return (self.int8.xq, self.int8.scale, self.int8.offset)


class Int4Gemv:
    """out = W x (+ bias), or out += W x, for one INT4 linear; built by make_gemv_int4."""

    def __init__(self, n, k, qweight, scales, *, path="prmt", bias=None, out_dtype="float32",
                 rows_per_warp=None, norm_weight=None, norm_eps=None):
        rows = default_rows_per_warp(n) if rows_per_warp is None else rows_per_warp
        _check(path, n, k, qweight, scales, rows)
        if out_dtype not in ("float32", "float16"):
            raise ValueError(f"out_dtype must be 'float32' or 'float16', got {out_dtype!r}")
        self._launcher = _Launcher(path, n, k, rows, norm_weight, norm_eps)
        self.n, self.k, self.path, self.rows_per_warp, self.out_dtype = n, k, path, rows, out_dtype
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.bias = None if bias is None else on_device(bias, np.float16)
        if self.bias is not None and tuple(self.bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(self.bias.shape)}")

    def kernel(self, residual: bool = False):
        """The compiled-on-first-use kernel this object launches."""
        if residual and self.out_dtype != "float32":
            raise ValueError("a residual GEMV accumulates into float32")
        return gemv_kernel(self.path, self.n, self.k, self.rows_per_warp, self.bias is not None, residual,
                           self._launcher.kernel_norm_eps)

    def launch(self, stream, x, out, *, residual: bool = False) -> None:
        """out[N] = W x (+ bias), or out[N] += W x when residual; x float16 [K] on the device
        (with a norm: x float32 h [K], and the GEMV reads RMSNorm(h) * norm_weight)."""
        kernel = self.kernel(residual)
        activations = self._launcher.activations(stream, x)
        bias = self.scales if self.bias is None else self.bias  # any float array when unused
        kernel[self._launcher.grid, THREADS_PER_BLOCK, stream](self.qweight, self.scales, activations, bias, out)


class GateUpSilu:
    """out = silu(Wg x) * (Wu x) in float16, gate and up read in one pass; built by make_gate_up_silu."""

    def __init__(self, n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", rows_per_warp=None,
                 norm_weight=None, norm_eps=None):
        rows = default_rows_per_warp(n, matrices=2) if rows_per_warp is None else rows_per_warp
        _check(path, n, k, gate_q, gate_s, rows)
        _check(path, n, k, up_q, up_s, rows)
        self._launcher = _Launcher(path, n, k, rows, norm_weight, norm_eps)
        self.n, self.k, self.path, self.rows_per_warp = n, k, path, rows
        self.gate_q = on_device(gate_q, np.uint32).reshape(n * k // 8)
        self.gate_s = on_device(gate_s, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8)
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE)

    def kernel(self):
        return gate_up_kernel(self.path, self.n, self.k, self.rows_per_warp, self._launcher.kernel_norm_eps)

    def launch(self, stream, x, out) -> None:
        """out float16 [N] = silu(Wg x) * (Wu x); x float16 [K] on the device (with a norm:
        float32 h [K], as Int4Gemv.launch)."""
        activations = self._launcher.activations(stream, x)
        self.kernel()[self._launcher.grid, THREADS_PER_BLOCK, stream](
            self.gate_q, self.gate_s, self.up_q, self.up_s, activations, out)


def make_gemv_int4(n, k, qweight, scales, *, path="prmt", bias=None, out_dtype="float32",
                   rows_per_warp=None, norm_weight=None, norm_eps=None) -> Int4Gemv:
    """An INT4 GEMV for W [n, k] (qweight uint32 [n, k/8], scales float16 [n, k/128]); with
    norm_weight (float16 [k]) and norm_eps it reads RMSNorm(h) * norm_weight of a float32 h."""
    return Int4Gemv(n, k, qweight, scales, path=path, bias=bias, out_dtype=out_dtype,
                    rows_per_warp=rows_per_warp, norm_weight=norm_weight, norm_eps=norm_eps)


def make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", rows_per_warp=None,
                      norm_weight=None, norm_eps=None) -> GateUpSilu:
    """The fused MLP input projection: silu(Wg x) * (Wu x) for Wg, Wu [n, k] in INT4 (x optionally
    RMSNorm(h) * norm_weight, as make_gemv_int4)."""
    return GateUpSilu(n, k, gate_q, gate_s, up_q, up_s, path=path, rows_per_warp=rows_per_warp,
                      norm_weight=norm_weight, norm_eps=norm_eps)


def gemv_bytes(n: int, k: int) -> int:
    """Bytes one GEMV over W [n, k] must read from memory: qweight, scales and x once."""
    return n * k // 2 + 2 * n * (k // GROUP_SIZE) + 2 * k


def _signature(path: str, *, gate_up: bool = False, out=types.float32, norm: bool = False):
    """The kernel's Numba signature (contiguous 1-D arrays; `out` float32 or float16)."""
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    if norm:
        activations = types.Tuple((types.float32[::1], flat_u32))
    elif path == "prmt":
        activations = types.UniTuple(flat_u32, 1)
    else:
        activations = types.Tuple((flat_u32, types.float32[::1], types.int32[::1]))
    if gate_up:
        return types.void(flat_u32, flat_f16, flat_u32, flat_f16, activations, flat_f16)
    return types.void(flat_u32, flat_f16, activations, flat_f16, out[::1])


def compile_targets() -> list[CompileTarget]:
    """Both paths at every 7B linear (with the epilogue the engine uses there) and at a tiny shape."""
    hidden, intermediate, qkv, vocab = 3584, 18944, 4608, 152064
    targets = []
    for path in PATHS:
        must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32") + (
            ("prmt.b32", "fma.rn.f16x2") if path == "prmt" else ("dp4a.s32.s32",))
        for name, n, k, bias, residual, out in (("qkv", qkv, hidden, True, False, types.float32),
                                                ("o_proj", hidden, hidden, False, True, types.float32),
                                                ("down_proj", hidden, intermediate, False, True, types.float32),
                                                ("lm_head", vocab, hidden, False, False, types.float32),
                                                ("tiny, float16 out", 16, 256, True, False, types.float16)):
            kernel = gemv_kernel(path, n, k, default_rows_per_warp(n), bias, residual)
            targets.append(CompileTarget(f"gemv_int4_{path}[{name} {n}x{k}]", kernel, _signature(path, out=out),
                                         must))
        for name, n, k in (("gate_up", intermediate, hidden), ("tiny", 16, 256)):
            kernel = gate_up_kernel(path, n, k, default_rows_per_warp(n, matrices=2))
            targets.append(CompileTarget(f"gate_up_silu_{path}[{name} {n}x{k}]", kernel,
                                         _signature(path, gate_up=True), must))
    # The prmt kernels that read RMSNorm(h) (the engine's qkv, gate-up and lm_head).
    must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32", "prmt.b32", "fma.rn.f16x2", "cvt.rn.f16x2.f32")
    for name, n, k, bias in (("qkv", qkv, hidden, True), ("lm_head", vocab, hidden, False)):
        kernel = gemv_kernel("prmt", n, k, default_rows_per_warp(n), bias, False, 1e-6)
        targets.append(CompileTarget(f"gemv_int4_prmt[{name} {n}x{k}, fused rmsnorm]", kernel,
                                     _signature("prmt", norm=True), must))
    kernel = gate_up_kernel("prmt", intermediate, hidden, default_rows_per_warp(intermediate, matrices=2), 1e-6)
    targets.append(CompileTarget(f"gate_up_silu_prmt[gate_up {intermediate}x{hidden}, fused rmsnorm]", kernel,
                                 _signature("prmt", gate_up=True, norm=True), must))
    return targets
