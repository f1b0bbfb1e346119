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

Work split (`GemvPlan`). A "tile" is R consecutive rows (of each matrix: gate/up read R rows of
both). The grid is persistent: at most `blocks_per_sm` blocks of `warps` warps per SM, and warp w
of the grid computes tiles w, w + W_total, w + 2 W_total, ... (W_total warps in all), so a block
stages x once and then streams weights for its whole life instead of for 3-4 loads. Lane L of a
warp takes 16-byte chunks c = L, L + 32, ... of its tile's rows (chunk c = inputs 32c .. 32c+31 =
words 4c .. 4c+3 of a row): one step of the warp reads 512 contiguous bytes of each of the R rows.
A lane's steps over all its tiles form one sequence of items (tile, step), and the lane keeps the
next `depth` items' loads in flight: item i + depth is requested right after item i is computed,
across tile boundaries, so the weight stream does not pause between tiles. Each item's loads are
R (x matrices) 16-byte words and the R group scales of its chunk; the scales ride in the same
pipeline, because a scale read at compute time would stall the lane for a DRAM round trip at the
start of every tile. At a tile's last step the lane partial sums meet in a warp_sum; lane r stores
row r (epilogue). Slots are separate local arrays named at compile time (depth <= 4), so they stay
in registers.

Programmatic dependent launch (ptx/griddep.py, launch.py): the weights do not depend on the kernel
before this one, so every lane issues its first `depth` items' loads before it waits
(grid_dependency_wait) for the activations: the loads are in flight while the previous kernel's
tail drains. A thread signals launch_dependents once it has issued its last load, so the next
kernel starts requesting its own weights while this one finishes.

Activations live in shared memory, staged once per block with every copy in flight at once
(cp.async; with a fused norm, all of h's loads first): one L2 round trip. prmt path: chunk c's 16 half2 words sit
at xs[20 c .. 20 c + 15] (64 bytes used of 80), read as four `ld.shared.v4`: a quarter-warp's 8
lanes read 8 chunks 80 bytes apart, which fall in 8 disjoint groups of 4 banks (no conflict; a
64-byte stride would put 4 lanes on one bank group). dp4a path: the quantizer writes the INT8
words already in the order the GEMV reads them, xq[j * K/32 + c], copied as is (32 lanes read 32
consecutive words).

Memory traffic per call (`gemv_bytes`): N*K/2 bytes of qweight + N*K/64 of scales + 2K of x.
At the H200's ~4.3 TB/s that is, for the 7B shapes: qkv 4608x3584 8.5 MB 2.0 us, o_proj 3584x3584
6.6 MB 1.5 us, gate+up 2 x 18944x3584 70.0 MB 16.3 us, down 3584x18944 35.0 MB 8.2 us, INT4
lm_head 152064x3584 281 MB 65 us; per decode step (28 layers + lm_head) 3.65 GB, 0.85 ms. What
each shape reaches, standalone and in the decode step: docs/PERFORMANCE.md.

Fused RoPE and KV write (the decode step's QKV, `rope_heads=`, `launch_rope`): tile t is the row
pair (d, d + head_dim/2) of one head instead of two consecutive rows, so the warp that finishes it
holds both elements RoPE rotates together; lane 0 adds the bias, rotates a q pair into q, a k
pair into the position's KV-page slot (float16), and copies a v pair there (kernels/rope_kv_write.py
does the same for prefill rows). One launch and one kernel boundary per layer fewer.

Fused RMSNorm (prmt path): built with norm_weight / norm_eps, the kernel takes the float32
residual stream h instead of x and stages xn = float16(h * rsqrt(mean h^2 + eps) * weight), the
same float32 expression as kernels/rmsnorm.py: each block sums h^2 over all K (from L2, while its
first weight loads are in flight), then converts pairs with `cvt.rn.f16x2.f32` into the layout
above. The dp4a path runs kernels/rmsnorm.py into its own float16 workspace first.

API (the engine builds these once per layer, at load):

    gemv = make_gemv_int4(n, k, qweight, scales, path="prmt", bias=None, out_dtype="float32")
    gemv.launch(stream, x, out)                  # out[N] = W x (+ bias); x float16 [K]
    gemv.launch(stream, x, h, residual=True)     # h[N] += W x (o_proj, down_proj)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path="prmt")
    mlp.launch(stream, x, out)                   # out float16 [N] = silu(Wg x) * (Wu x)
    qkv = make_gemv_int4(..., norm_weight=w, norm_eps=eps)
    qkv.launch(stream, h, out)                   # x = RMSNorm(h) * w, h float32 [K]

Weights and bias (float16 [N]) may be numpy arrays (copied to the device once) or device arrays
(used in place). Both factories take `plan=` (default: `default_plan(n, k, matrices)`). On the
dp4a path each object owns its INT8 workspace and `launch` runs two kernels, quantizer then GEMV.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32
from numba.core import types

from ..config import GROUP_SIZE
from ..launch import launch, multiprocessor_count
from ..ptx import SIMULATOR
from ..ptx.dp4a import dp4a
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.half2 import float2_to_half2, fma_f16x2, half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.mma import SHARED_ALIGNMENT, cp_async_16, cp_async_commit_group, cp_async_wait_group, ld_shared_v4_u32
from ..ptx.prmt import prmt
from ..ptx.warp import warp_sum
from . import CompileTarget, on_device
from .page_alloc import PAGE_SIZE
from .quantize_activation import Int8Activations
from .rmsnorm import make_rmsnorm

PATHS = ("prmt", "dp4a")
CHUNKS_PER_GROUP = GROUP_SIZE // 32  # 16-byte weight chunks (32 inputs) sharing one scale
CHUNK_STRIDE = 20  # shared words between consecutive chunks' activations on the prmt path (16 used)
MAX_DEPTH = 4  # pipeline slots a kernel can have (each one a named local array)


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    """How a GEMV splits its work (module docstring): R rows per tile, `depth` items in flight per
    lane, `warps` per block, at most `blocks_per_sm` blocks per SM (also the launch bound that caps
    registers at 65536 / (32 warps blocks_per_sm))."""

    rows: int = 1
    depth: int = 4
    warps: int = 8
    blocks_per_sm: int = 2

    def check(self, n: int) -> None:
        if self.rows not in (1, 2, 4) or n % self.rows:
            raise ValueError(f"rows={self.rows} must be 1, 2 or 4 and divide N={n}")
        if not 1 <= self.depth <= MAX_DEPTH or not 1 <= self.warps <= 32 or self.blocks_per_sm < 1:
            raise ValueError(f"{self}: depth 1..{MAX_DEPTH}, warps 1..32, blocks_per_sm >= 1")

    def grid(self, n: int, sm_count: int) -> int:
        """Blocks of the persistent grid. Each warp computes `rounds` tiles (or one fewer), the
        fewest that at most blocks_per_sm blocks per SM allow; the grid is then as small as that
        leaves it, so no warp has a whole extra tile to do while others idle (3584 down_proj rows
        on 2112 warps took 2 rounds on 1472 of them and 1 on the rest)."""
        tiles = n // self.rows
        rounds = -(-tiles // (self.blocks_per_sm * sm_count * self.warps))
        return max(1, -(-(-(-tiles // rounds)) // self.warps))


ROPE_PLAN = GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2)  # QKV with RoPE: row pairs (d, d + head_dim/2)


def default_plan(n: int, k: int, matrices: int = 1) -> GemvPlan:
    """The plan the engine uses for an N x K linear (`matrices` 2 for gate/up), the fastest of
    dev/gemv_plans.py's sweep at each 7B shape (docs/PERFORMANCE.md): 8 loads of 16 bytes in flight
    per lane; a long K (down_proj) keeps 4 rows a warp on one block an SM."""
    if matrices == 2:
        return GemvPlan(rows=1, depth=4, warps=8, blocks_per_sm=2)
    if k >= 8192:
        return GemvPlan(rows=4, depth=2, warps=8, blocks_per_sm=1)
    return GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2)


def _half2(value: float) -> np.uint32:
    """The uint32 bits of the half2 (value, value)."""
    return np.array([value, value], dtype=np.float16).view(np.uint32)[0]


# The prmt unpack (pynanoqwen/quant.py, unpack_prmt_reference, is the numpy model of these steps).
MAGIC_EXPONENTS = np.uint32(0x64646464)  # prmt pool bytes 4..7: FP16 high byte 0x64 = 1024.0
SELECT_BYTES_0_1 = np.uint32(0x4140)  # halves (0x64, byte 0), (0x64, byte 1): weights 0-3
SELECT_BYTES_2_3 = np.uint32(0x4342)  # halves (0x64, byte 2), (0x64, byte 3): weights 4-7
LOW_NIBBLES = np.uint32(0x640F640F)  # -> (1024 + u_a, 1024 + u_b)
HIGH_NIBBLES = np.uint32(0x64F064F0)  # -> (1024 + 16 u_a, 1024 + 16 u_b)
ONE = _half2(1.0)
MINUS_1032 = _half2(-1032.0)  # (1024 + u) - 1032 = u - 8, the signed weight
ONE_SIXTEENTH = _half2(1.0 / 16.0)
MINUS_72 = _half2(-72.0)  # (1024 + 16u) / 16 - 72 = u - 8
# The dp4a unpack: the four low nibbles, or (after >> 4) the four high ones, as bytes.
NIBBLE_BYTES = np.uint32(0x0F0F0F0F)


@cuda.jit(device=True, inline="always")
def dot8_prmt(word, x01, x23, x45, x67, acc):
    """acc + (w0 x0 + w2 x2 + w4 x4 + w6 x6, w1 x1 + w3 x3 + w5 x5 + w7 x7) in half2.

    `word` holds weights w0..w7 (nibbles u = w + 8, ValueShuffle); x01 .. x67 are the half2 pairs
    (x0, x1) .. (x6, x7). All FP16 steps are exact except the accumulating FMAs.
    """
    t = prmt(word, MAGIC_EXPONENTS, SELECT_BYTES_0_1)
    acc = fma_f16x2(fma_f16x2(t & LOW_NIBBLES, ONE, MINUS_1032), x01, acc)
    acc = fma_f16x2(fma_f16x2(t & HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72), x23, acc)
    t = prmt(word, MAGIC_EXPONENTS, SELECT_BYTES_2_3)
    acc = fma_f16x2(fma_f16x2(t & LOW_NIBBLES, ONE, MINUS_1032), x45, acc)
    acc = fma_f16x2(fma_f16x2(t & HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72), x67, acc)
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
_Path = collections.namedtuple("_Path", "shared_words stage load_x multiply")
U = np.uint32  # to spell unsigned constants in kernels


@functools.cache
def _prmt_path(k: int, rows: int, threads: int, norm_eps: float | None = None) -> _Path:
    """The prmt path; with norm_eps, x is RMSNorm(h) * weight, computed while staging (below)."""
    quads = U(k // 8)  # 16-byte pieces of x: quad q = half2 words 4q .. 4q+3 = words 4(q%4).. of chunk q//4
    warps = threads // 32

    @cuda.jit(device=True, inline="always")
    def quad_slot(q):
        return U(CHUNK_STRIDE) * (q // U(4)) + U(4) * (q % U(4))

    @cuda.jit(device=True, inline="always")
    def stage_x(activations, xs):
        # cp.async, all copies of this thread in flight together: the block waits one L2 round
        # trip for x, not one per loop iteration (a load-then-store loop staged the 37 KiB x of
        # down_proj in ~10 us on the H200).
        x_pairs = activations[0]
        q = U(cuda.threadIdx.x)
        while q < quads:
            cp_async_16(xs, quad_slot(q), x_pairs, U(4) * q, U(16))
            q += U(threads)
        cp_async_commit_group()
        cp_async_wait_group(0)
        cuda.syncthreads()

    inv_k = np.float32(1.0 / k)
    eps = np.float32(0.0 if norm_eps is None else norm_eps)

    quads_per_thread = -(-(k // 8) // threads)
    values_per_thread, weight_words_per_thread = 8 * quads_per_thread, 4 * quads_per_thread

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
        weights = cuda.local.array(weight_words_per_thread, uint32)
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

    return _Path(CHUNK_STRIDE * (k // 32), stage_x if norm_eps is None else stage_normed, load_x, multiply)


@functools.cache
def _dp4a_path(k: int, rows: int, threads: int) -> _Path:
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

    return _Path(k // 4, stage, load_x, multiply)


def _path(path: str, k: int, rows: int, threads: int, norm_eps: float | None = None) -> _Path:
    if norm_eps is not None and path != "prmt":
        raise ValueError("only the prmt path fuses RMSNorm into its staging")
    return _prmt_path(k, rows, threads, norm_eps) if path == "prmt" else _dp4a_path(k, rows, threads)


# out = Wx; out = Wx + b; out += Wx; out = silu(Wg x) Wu x; and "rope": the QKV projection's
# bias, RoPE and KV-cache write (module docstring), out = (q, k_pages, v_pages, page_table, pos,
# rope_cos, rope_sin).
EPILOGUES = ("store", "bias", "residual", "silu", "rope")


@functools.cache
def gemv_kernel(path: str, n: int, k: int, matrices: int, plan: GemvPlan, grid: int, epilogue: str,
                norm_eps: float | None = None, heads: tuple[int, int, int] | None = None):
    """gemv_int4(q0, s0, q1, s1, activations, bias, out) for one shape, path, plan, grid and epilogue.

    q/s are flat qweight uint32 [N*K/8] and scales float16 [N*K/128] of matrix 0 (and 1 for
    gate/up; pass matrix 0 again otherwise); `bias` (float16 [N]) is read by the bias and rope
    epilogues (pass any float16 array otherwise); out is float32 or float16 [N], or for "rope"
    (heads = (num_heads, num_kv_heads, head_dim), rows = 2) the tuple of RopeOutputs.
    """
    rows, depth, warps = plan.rows, plan.depth, plan.warps
    threads = 32 * warps
    shared_words, stage, load_x, multiply = _path(path, k, rows, threads, norm_eps)
    chunks = U(k // 32)
    steps = U(-(-(k // 32) // 32))  # a lane's steps over one tile (the last may leave lanes idle)
    words_per_row = U(k // 8)
    groups = U(k // GROUP_SIZE)
    tiles = U(n // rows)
    total_warps = U(grid * warps)
    slot_words = 4 * rows * matrices
    slot_scales = rows * matrices
    x_words = 16 if path == "prmt" else 8
    silu, bias, residual, rope = (epilogue == e for e in ("silu", "bias", "residual", "rope"))
    num_heads, num_kv_heads, head_dim = heads if rope else (1, 1, 2)
    half = U(head_dim // 2)
    k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim

    @cuda.jit(device=True, inline="always")
    def row_of(tile, r):
        """Row r of a tile: consecutive rows, or for rope the pair (d, d + head_dim/2) of one head,
        so that one warp holds both elements RoPE rotates together."""
        if rope:
            return U(U(U(tile // half) * U(head_dim)) + U(tile % half) + U(U(r) * half))
        return U(U(tile * U(rows)) + U(r))

    # Index arithmetic. Numba widens every integer operation to 64 bits; each intermediate is
    # wrapped in U() so that LLVM narrows it back to 32 (down_proj's loop was two thirds 64-bit
    # adds, multiplies and a division by its 19 steps, and ran at half the speed of gate_up's).
    # A slot's item is tracked as (tile of this warp, step in the tile), advanced without dividing.

    @cuda.jit(device=True, inline="always")
    def advance(tile, step):
        """(tile, step) `depth` items later."""
        step = U(step + U(depth))
        while step >= steps:
            step = U(step - steps)
            tile = U(tile + U(1))
        return tile, step

    @cuda.jit(device=True, inline="always")
    def load(q0, s0, q1, s1, warp, lane, tile, step, count, words, scl):
        """The item (tile, step) of this lane (its tile's rows at chunk lane + 32 step) into a slot."""
        if tile < count:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                for r in range(rows):
                    row = row_of(U(warp + U(tile * total_warps)), r)
                    at = U(U(row * words_per_row) + U(U(4) * c))
                    scale_at = U(U(row * groups) + U(c // U(CHUNKS_PER_GROUP)))
                    words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = ld_global_nc_v4_u32(q0, at)
                    scl[r] = s0[scale_at]
                    if matrices == 2:
                        b = 4 * (rows + r)
                        words[b], words[b + 1], words[b + 2], words[b + 3] = ld_global_nc_v4_u32(q1, at)
                        scl[rows + r] = s1[scale_at]

    @cuda.jit(device=True, inline="always")
    def finish_rope(tile, lane, acc, bias_values, out):
        """The QKV tile (d, d + half) of one head: + bias, then a q head is rotated into q, a k head
        rotated into its KV page slot, a v head copied there (kernels/rope_kv_write.py's math)."""
        x1 = warp_sum(acc[0])
        x2 = warp_sum(acc[1])
        if lane == U(0):
            q_out, k_pages, v_pages, page_table, pos, rope_cos, rope_sin = out
            first = row_of(tile, 0)
            x1 += float32(bias_values[first])
            x2 += float32(bias_values[first + half])
            head = first // U(head_dim)
            d = first % U(head_dim)
            p = pos[0]
            page, slot = page_table[p // PAGE_SIZE], p % PAGE_SIZE
            if first < U(v_start):
                c, sn = rope_cos[p, d], rope_sin[p, d]
                y1, y2 = x1 * c - x2 * sn, x2 * c + x1 * sn
                if first < U(k_start):
                    q_out[first] = y1
                    q_out[first + half] = y2
                else:
                    kv = head - U(num_heads)
                    k_pages[page, kv, slot, d] = y1
                    k_pages[page, kv, slot, d + half] = y2
            else:
                kv = head - U(num_heads + num_kv_heads)
                v_pages[page, kv, slot, d] = x1
                v_pages[page, kv, slot, d + half] = x2
        for i in range(slot_scales):
            acc[i] = float32(0)

    @cuda.jit(device=True, inline="always")
    def finish(row0, lane, acc, bias_values, out):
        """A tile's last step: the lane sums meet (warp_sum); lane r stores row r's epilogue."""
        for r in range(rows):
            total = warp_sum(acc[r])
            second = float32(0)
            if matrices == 2:
                second = warp_sum(acc[rows + r])
            if lane == U(r):
                row = row0 + U(r)
                if silu:
                    out[row] = total / (float32(1) + math.exp(-total)) * second
                elif residual:
                    out[row] += total
                elif bias:
                    out[row] = total + float32(bias_values[row])
                else:
                    out[row] = total
        for i in range(slot_scales):
            acc[i] = float32(0)

    @cuda.jit(device=True, inline="always")
    def compute(warp, lane, tile, step, count, words, scl, activations, xs, xv, acc, bias_values, out):
        """Add the item (tile, step), already in this slot, into acc; at a tile's last step, finish it."""
        if tile < count:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                load_x(xs, c, xv)
                multiply(words, 0, scl, 0, c, activations, xv, acc, 0)
                if matrices == 2:
                    multiply(words, 4 * rows, scl, rows, c, activations, xv, acc, rows)
            if step == U(steps - U(1)):
                if rope:
                    finish_rope(U(warp + U(tile * total_warps)), lane, acc, bias_values, out)
                else:
                    finish(U(U(warp + U(tile * total_warps)) * U(rows)), lane, acc, bias_values, out)

    # The launch bound caps registers so that blocks_per_sm blocks fit (the simulator has no such option).
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, plan.blocks_per_sm)}))
    def gemv_int4(q0, s0, q1, s1, activations, bias_values, out):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        words0 = cuda.local.array(slot_words, uint32)
        words1 = cuda.local.array(slot_words, uint32)
        words2 = cuda.local.array(slot_words, uint32)
        words3 = cuda.local.array(slot_words, uint32)
        scl0 = cuda.local.array(slot_scales, types.float16)
        scl1 = cuda.local.array(slot_scales, types.float16)
        scl2 = cuda.local.array(slot_scales, types.float16)
        scl3 = cuda.local.array(slot_scales, types.float16)
        xv = cuda.local.array(x_words, uint32)
        acc = cuda.local.array(slot_scales, float32)
        lane = U(cuda.laneid)
        warp = U(U(U(cuda.blockIdx.x) * U(warps)) + U(U(cuda.threadIdx.x) // U(32)))
        count = U(U(U(tiles - U(1) - warp) // total_warps) + U(1)) if warp < tiles else U(0)  # this warp's tiles
        items = U(count * steps)
        # Slot s starts at item s; its (tile, step) cursor then moves `depth` items a round.
        tile0, step0 = U(0), U(0)
        tile1, step1 = U(U(1) // steps), U(U(1) % steps)
        tile2, step2 = U(U(2) // steps), U(U(2) % steps)
        tile3, step3 = U(U(3) // steps), U(U(3) % steps)
        # The weights do not depend on the kernel before this one: request them first, then wait
        # for the activations (ptx/griddep.py).
        load(q0, s0, q1, s1, warp, lane, tile0, step0, count, words0, scl0)
        if depth >= 2:
            load(q0, s0, q1, s1, warp, lane, tile1, step1, count, words1, scl1)
        if depth >= 3:
            load(q0, s0, q1, s1, warp, lane, tile2, step2, count, words2, scl2)
        if depth >= 4:
            load(q0, s0, q1, s1, warp, lane, tile3, step3, count, words3, scl3)
        grid_dependency_wait()
        stage(activations, xs)
        for i in range(slot_scales):
            acc[i] = float32(0)
        item = U(0)
        triggered = False
        while item < items:
            compute(warp, lane, tile0, step0, count, words0, scl0, activations, xs, xv, acc, bias_values, out)
            tile0, step0 = advance(tile0, step0)
            load(q0, s0, q1, s1, warp, lane, tile0, step0, count, words0, scl0)
            if depth >= 2:
                compute(warp, lane, tile1, step1, count, words1, scl1, activations, xs, xv, acc, bias_values, out)
                tile1, step1 = advance(tile1, step1)
                load(q0, s0, q1, s1, warp, lane, tile1, step1, count, words1, scl1)
            if depth >= 3:
                compute(warp, lane, tile2, step2, count, words2, scl2, activations, xs, xv, acc, bias_values, out)
                tile2, step2 = advance(tile2, step2)
                load(q0, s0, q1, s1, warp, lane, tile2, step2, count, words2, scl2)
            if depth >= 4:
                compute(warp, lane, tile3, step3, count, words3, scl3, activations, xs, xv, acc, bias_values, out)
                tile3, step3 = advance(tile3, step3)
                load(q0, s0, q1, s1, warp, lane, tile3, step3, count, words3, scl3)
            item = U(item + U(depth))
            if not triggered and U(item + U(depth)) >= items:
                # This thread has issued its last load: the next kernel may start and request its
                # weights while this block finishes (a trigger at the start put the next kernel's
                # blocks beside this one's for its whole run, which measured slower).
                launch_dependents()
                triggered = True
        if not triggered:
            launch_dependents()

    return gemv_int4


def _check(path: str, n: int, k: int, qweight, scales, plan: GemvPlan) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown GEMV path {path!r}; choose one of {PATHS}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    if tuple(qweight.shape) != (n, k // 8) or tuple(scales.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not match "
                         f"N={n}, K={k}")
    plan.check(n)


class GemvInput:
    """What both GEMV objects share: the grid, the activations the kernel reads, and on the dp4a
    path the INT8 workspace.

    With a norm (weight float16 [K], eps) the input is the float32 residual stream h and the GEMV
    reads x = RMSNorm(h) * weight: the prmt kernel computes it while staging (one launch); the
    dp4a path runs kernels/rmsnorm.py into its own float16 workspace, then quantizes that.
    """

    def __init__(self, path: str, n: int, k: int, plan: GemvPlan, norm_weight=None, norm_eps=None):
        if (norm_weight is None) != (norm_eps is None):
            raise ValueError("norm_weight and norm_eps go together")
        self.path, self.n, self.k, self.plan = path, n, k, plan
        self.grid = plan.grid(n, multiprocessor_count())
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
                 plan=None, norm_weight=None, norm_eps=None, rope_heads=None):
        if rope_heads is not None:
            num_heads, num_kv_heads, head_dim = rope_heads
            plan = ROPE_PLAN if plan is None else plan
            if plan.rows != 2 or n != (num_heads + 2 * num_kv_heads) * head_dim or bias is None or head_dim % 2:
                raise ValueError(f"a QKV GEMV with RoPE needs rows=2 (got {plan.rows}), N = (heads + 2 kv heads) "
                                 f"x head_dim (got {n} for {rope_heads}) and a bias")
        plan = default_plan(n, k) if plan is None else plan
        _check(path, n, k, qweight, scales, plan)
        if out_dtype not in ("float32", "float16"):
            raise ValueError(f"out_dtype must be 'float32' or 'float16', got {out_dtype!r}")
        self.rope_heads = None if rope_heads is None else tuple(rope_heads)
        self._input = GemvInput(path, n, k, plan, norm_weight, norm_eps)
        self.n, self.k, self.path, self.plan, self.out_dtype = n, k, path, plan, out_dtype
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.bias = None if bias is None else on_device(bias, np.float16)
        if self.bias is not None and tuple(self.bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(self.bias.shape)}")

    def kernel(self, residual: bool = False):
        """The compiled-on-first-use kernel this object launches."""
        if residual and self.out_dtype != "float32":
            raise ValueError("a residual GEMV accumulates into float32")
        if self.rope_heads is not None:
            return gemv_kernel(self.path, self.n, self.k, 1, self.plan, self._input.grid, "rope",
                               self._input.kernel_norm_eps, self.rope_heads)
        epilogue = "residual" if residual else "bias" if self.bias is not None else "store"
        return gemv_kernel(self.path, self.n, self.k, 1, self.plan, self._input.grid, epilogue,
                           self._input.kernel_norm_eps)

    def launch(self, stream, x, out, *, residual: bool = False) -> None:
        """out[N] = W x (+ bias), or out[N] += W x when residual; x float16 [K] on the device
        (with a norm: x float32 h [K], and the GEMV reads RMSNorm(h) * norm_weight)."""
        if self.rope_heads is not None:
            raise ValueError("this QKV GEMV applies RoPE: use launch_rope")
        kernel = self.kernel(residual)
        activations = self._input.activations(stream, x)
        bias = self.scales if self.bias is None else self.bias  # any float16 array when unused
        launch(kernel, self._input.grid, 32 * self.plan.warps, stream,
               (self.qweight, self.scales, self.qweight, self.scales, activations, bias, out))

    def launch_rope(self, stream, x, q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin) -> None:
        """The decode step's QKV projection (built with rope_heads): qkv = W x + bias for the token at
        position pos[0], then q float32 [num_heads, head_dim] = RoPE(q part), and that position's
        slot of k_pages (RoPE(k part)) and v_pages (v part), float16 [pages, kv heads, 16, head_dim],
        through page_table; rope_cos/rope_sin as kernels/rope_kv_write.rope_cos_sin."""
        activations = self._input.activations(stream, x)
        out = (q.reshape(q.size), k_pages, v_pages, page_table, pos, rope_cos, rope_sin)
        launch(self.kernel(), self._input.grid, 32 * self.plan.warps, stream,
               (self.qweight, self.scales, self.qweight, self.scales, activations, self.bias, out))


class GateUpSilu:
    """out = silu(Wg x) * (Wu x) in float16, gate and up read in one pass; built by make_gate_up_silu."""

    def __init__(self, n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", plan=None,
                 norm_weight=None, norm_eps=None):
        plan = default_plan(n, k, matrices=2) if plan is None else plan
        _check(path, n, k, gate_q, gate_s, plan)
        _check(path, n, k, up_q, up_s, plan)
        self._input = GemvInput(path, n, k, plan, norm_weight, norm_eps)
        self.n, self.k, self.path, self.plan = n, k, path, plan
        self.gate_q = on_device(gate_q, np.uint32).reshape(n * k // 8)
        self.gate_s = on_device(gate_s, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8)
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE)

    def kernel(self):
        return gemv_kernel(self.path, self.n, self.k, 2, self.plan, self._input.grid, "silu",
                           self._input.kernel_norm_eps)

    def launch(self, stream, x, out) -> None:
        """out float16 [N] = silu(Wg x) * (Wu x); x float16 [K] on the device (with a norm:
        float32 h [K], as Int4Gemv.launch)."""
        activations = self._input.activations(stream, x)
        launch(self.kernel(), self._input.grid, 32 * self.plan.warps, stream,
               (self.gate_q, self.gate_s, self.up_q, self.up_s, activations, self.gate_s, out))


def make_gemv_int4(n, k, qweight, scales, *, path="prmt", bias=None, out_dtype="float32",
                   plan=None, norm_weight=None, norm_eps=None, rope_heads=None) -> Int4Gemv:
    """An INT4 GEMV for W [n, k] (qweight uint32 [n, k/8], scales float16 [n, k/128]); with
    norm_weight (float16 [k]) and norm_eps it reads RMSNorm(h) * norm_weight of a float32 h; with
    rope_heads = (num_heads, num_kv_heads, head_dim) it is the QKV projection whose epilogue
    applies the bias, RoPE and the KV-cache write (launch_rope)."""
    return Int4Gemv(n, k, qweight, scales, path=path, bias=bias, out_dtype=out_dtype, plan=plan,
                    norm_weight=norm_weight, norm_eps=norm_eps, rope_heads=rope_heads)


def make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", plan=None,
                      norm_weight=None, norm_eps=None) -> GateUpSilu:
    """The fused MLP input projection: silu(Wg x) * (Wu x) for Wg, Wu [n, k] in INT4 (x optionally
    RMSNorm(h) * norm_weight, as make_gemv_int4)."""
    return GateUpSilu(n, k, gate_q, gate_s, up_q, up_s, path=path, plan=plan,
                      norm_weight=norm_weight, norm_eps=norm_eps)


def gemv_bytes(n: int, k: int) -> int:
    """Bytes one GEMV over W [n, k] must read from memory: qweight, scales and x once."""
    return n * k // 2 + 2 * n * (k // GROUP_SIZE) + 2 * k


def _signature(path: str, *, out=types.float32, norm: bool = False):
    """The kernel's Numba signature (contiguous 1-D arrays; `out` float32 or float16)."""
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    if norm:
        activations = types.Tuple((types.float32[::1], flat_u32))
    elif path == "prmt":
        activations = types.UniTuple(flat_u32, 1)
    else:
        activations = types.Tuple((flat_u32, types.float32[::1], types.int32[::1]))
    return types.void(flat_u32, flat_f16, flat_u32, flat_f16, activations, flat_f16, out[::1])


COMPILE_SM_COUNT = 132  # the grid the compile targets are built for (an H200's SMs)


def compile_targets() -> list[CompileTarget]:
    """Both paths at every 7B linear (with the epilogue the engine uses there) and at a tiny shape."""
    hidden, intermediate, qkv, vocab = 3584, 18944, 4608, 152064
    targets = []
    for path in PATHS:
        must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32", "griddepcontrol.wait",
                "griddepcontrol.launch_dependents") + (
            ("prmt.b32", "fma.rn.f16x2", "ld.shared.v4.u32") if path == "prmt" else ("dp4a.s32.s32",))
        for name, n, k, matrices, epilogue, out in (
                ("qkv", qkv, hidden, 1, "bias", types.float32),
                ("o_proj", hidden, hidden, 1, "residual", types.float32),
                ("gate_up", intermediate, hidden, 2, "silu", types.float16),
                ("down_proj", hidden, intermediate, 1, "residual", types.float32),
                ("lm_head", vocab, hidden, 1, "store", types.float32),
                ("tiny, float16 out", 16, 256, 1, "bias", types.float16)):
            plan = default_plan(n, k, matrices)
            kernel = gemv_kernel(path, n, k, matrices, plan, plan.grid(n, COMPILE_SM_COUNT), epilogue)
            targets.append(CompileTarget(f"gemv_int4_{path}[{name} {n}x{k}, {plan}]", kernel,
                                         _signature(path, out=out), must))
    # The decode step's QKV: fused norm, bias, RoPE and the KV write (both paths).
    pages = types.float16[:, :, :, ::1]
    rope_out = types.Tuple((types.float32[::1], pages, pages, types.int32[::1], types.int32[::1],
                            types.float32[:, ::1], types.float32[:, ::1]))
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    for path, activations, eps in (("prmt", types.Tuple((types.float32[::1], flat_u32)), 1e-6),
                                   ("dp4a", types.Tuple((flat_u32, types.float32[::1], types.int32[::1])), None)):
        kernel = gemv_kernel(path, qkv, hidden, 1, ROPE_PLAN, ROPE_PLAN.grid(qkv, COMPILE_SM_COUNT), "rope", eps,
                             (28, 4, 128))
        targets.append(CompileTarget(f"gemv_int4_{path}[qkv {qkv}x{hidden}, rope + KV write]", kernel,
                                     types.void(flat_u32, flat_f16, flat_u32, flat_f16, activations, flat_f16,
                                                rope_out), ("griddepcontrol.wait", "cvt.rn.f16.f32")))
    # The prmt kernels that read RMSNorm(h) (the engine's qkv, gate-up and lm_head).
    must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32", "prmt.b32", "fma.rn.f16x2", "cvt.rn.f16x2.f32")
    for name, n, k, matrices, epilogue, out in (("qkv", qkv, hidden, 1, "bias", types.float32),
                                                ("gate_up", intermediate, hidden, 2, "silu", types.float16),
                                                ("lm_head", vocab, hidden, 1, "store", types.float32)):
        plan = default_plan(n, k, matrices)
        kernel = gemv_kernel("prmt", n, k, matrices, plan, plan.grid(n, COMPILE_SM_COUNT), epilogue, 1e-6)
        targets.append(CompileTarget(f"gemv_int4_prmt[{name} {n}x{k}, fused rmsnorm]", kernel,
                                     _signature("prmt", out=out, norm=True), must))
    return targets
