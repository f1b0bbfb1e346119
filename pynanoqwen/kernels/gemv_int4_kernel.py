"""The INT4 GEMV kernel that kernels/gemv_int4.py builds and launches: its two arithmetic paths,
its work split and load pipeline, the activation staging and the fused epilogues.

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
both); lane L of a warp takes 16-byte chunks c = L, L + 32, ... of its tile's rows (chunk c = inputs
32c .. 32c+31 = words 4c .. 4c+3 of a row), so one "item" (tile, step) of a warp reads 512
contiguous bytes of each of the R rows, and a tile is `steps` = ceil(K/1024) items. The grid is
persistent (at most blocks_per_sm blocks of `warps` warps on every SM), in one of two ways:
- whole tiles (the default): warp w of the grid computes tiles w, w + W_total, w + 2 W_total, ...
  (W_total warps in all), so at any moment the GPU reads one window of neighbouring rows;
- split_tiles: block b takes the b-th of `grid` equal runs of whole tiles, and warp w of the block
  the w-th of `warps` equal runs of that block's items, so every warp has the same work within one
  item whatever N is (whole tiles left down_proj's 3584 rows with 2 tiles on some warps and 1 on
  the rest). A run may begin or end inside a tile: the warp that holds a tile's last step finishes
  it; if the tile began before that warp's run, the warps before it leave their sums of it in
  shared memory (`partials`), and after one syncthreads at the end the finishing warp adds them in
  warp order. Measured, it helps down_proj and slows gate_up, o_proj and the lm_head, whose whole
  tiles were already balanced (docs/PERFORMANCE.md).
Either way the order of every addition is fixed by the plan and the shape, so repeated runs (graph
and eager) give the same bits; no atomics.
A lane keeps the next `depth` items' loads in flight: item i + depth is requested right after item
i is computed, across tile boundaries, so the weight stream does not pause between tiles. Each
item's loads are R (x matrices) 16-byte words and the R group scales of its chunk; the scales ride
in the same pipeline, because a scale read at compute time would stall the lane for a DRAM round
trip at the start of every tile. At a tile's last step the lane partial sums meet in a warp_sum;
lane r stores row r (epilogue). Slots are separate local arrays named at compile time (depth <= 4),
so they stay in registers.

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
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32
from numba.core import types

from ..config import GROUP_SIZE
from ..ptx import SIMULATOR
from ..ptx.dp4a import dp4a
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.half2 import float2_to_half2, fma_f16x2, half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.mma import (
    SHARED_ALIGNMENT,
    cp_async_16,
    cp_async_commit_group,
    cp_async_wait_group,
    ld_shared_v4_u32,
)
from ..ptx.warp import warp_sum
from . import PAGE_SIZE
from .int4_unpack import unpack8

CHUNKS_PER_GROUP = GROUP_SIZE // 32  # 16-byte weight chunks (32 inputs) sharing one scale
CHUNK_STRIDE = 20  # shared words between consecutive chunks' activations on the prmt path (16 used)
MAX_DEPTH = 4  # pipeline slots a kernel can have (each one a named local array)


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
def gemv_kernel(path: str, n: int, k: int, matrices: int, plan, grid: int, epilogue: str,
                norm_eps: float | None = None, heads: tuple[int, int, int] | None = None):
    """gemv_int4(q0, s0, q1, s1, activations, bias, out) for one shape, path, plan (a
    gemv_int4.GemvPlan), grid and epilogue.

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
    blocks = U(grid)
    total_warps = U(grid * warps)
    split = plan.split_tiles
    slot_words = 4 * rows * matrices
    slot_scales = rows * matrices
    partial_words = warps * slot_scales  # each warp's sums of a tile it leaves unfinished
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
    # A slot's item is tracked as (tile, step in the tile), advanced without dividing.

    @cuda.jit(device=True, inline="always")
    def advance(tile, step, by):
        """(tile, step) `by` items later."""
        step = U(step + U(by))
        while step >= steps:
            step = U(step - steps)
            tile = U(tile + U(1))
        return tile, step

    @cuda.jit(device=True, inline="always")
    def tile_of(warp_id, cursor):
        """The tile a warp's cursor points at: split plans walk their run of tiles directly; the
        others own tiles warp_id, warp_id + total_warps, ... (module docstring: work split)."""
        if split:
            return cursor
        return U(warp_id + U(cursor * total_warps))

    @cuda.jit(device=True, inline="always")
    def load(q0, s0, q1, s1, warp_id, lane, tile, step, valid, words, scl):
        """The item (tile, step) of this lane (its tile's rows at chunk lane + 32 step) into a slot."""
        if valid:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                for r in range(rows):
                    row = row_of(tile_of(warp_id, tile), r)
                    at = U(U(row * words_per_row) + U(U(4) * c))
                    scale_at = U(U(row * groups) + U(c // U(CHUNKS_PER_GROUP)))
                    words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = ld_global_nc_v4_u32(q0, at)
                    scl[r] = s0[scale_at]
                    if matrices == 2:
                        b = 4 * (rows + r)
                        words[b], words[b + 1], words[b + 2], words[b + 3] = ld_global_nc_v4_u32(q1, at)
                        scl[rows + r] = s1[scale_at]

    @cuda.jit(device=True, inline="always")
    def warp_totals(acc, totals):
        """totals = the warp's sums of acc (in every lane); acc restarts at zero."""
        for i in range(slot_scales):
            totals[i] = warp_sum(acc[i])
            acc[i] = float32(0)

    @cuda.jit(device=True, inline="always")
    def finish_rope(tile, lane, totals, bias_values, out):
        """The QKV tile (d, d + half) of one head: + bias, then a q head is rotated into q, a k head
        rotated into its KV page slot, a v head copied there (kernels/rope_kv_write.py's math)."""
        if lane == U(0):
            q_out, k_pages, v_pages, page_table, pos, rope_cos, rope_sin = out
            first = row_of(tile, 0)
            x1 = totals[0] + float32(bias_values[first])
            x2 = totals[1] + float32(bias_values[first + half])
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

    @cuda.jit(device=True, inline="always")
    def finish(tile, lane, totals, bias_values, out):
        """A tile's sums are complete (totals, in every lane): lane r stores row r's epilogue."""
        if rope:
            finish_rope(tile, lane, totals, bias_values, out)
            return
        for r in range(rows):
            if lane == U(r):
                row = U(U(tile * U(rows)) + U(r))
                total = totals[r]
                if silu:
                    out[row] = total / (float32(1) + math.exp(-total)) * totals[rows + r]
                elif residual:
                    out[row] += total
                elif bias:
                    out[row] = total + float32(bias_values[row])
                else:
                    out[row] = total

    @cuda.jit(device=True, inline="always")
    def compute(warp_id, lane, tile, step, valid, deferred_tile, words, scl, activations, xs, xv, acc, totals,
                deferred, bias_values, out):
        """Add the item (tile, step), already in this slot, into acc. At a tile's last step the tile
        is finished, unless it began before this warp's range (deferred_tile): its sums wait in
        `deferred` for the partials of the warps before this one (gemv_int4, after the loop)."""
        if valid:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                load_x(xs, c, xv)
                multiply(words, 0, scl, 0, c, activations, xv, acc, 0)
                if matrices == 2:
                    multiply(words, 4 * rows, scl, rows, c, activations, xv, acc, rows)
            if step == U(steps - U(1)):
                if tile == deferred_tile:
                    warp_totals(acc, deferred)
                else:
                    warp_totals(acc, totals)
                    finish(tile_of(warp_id, tile), lane, totals, bias_values, out)

    # The launch bound caps registers so that blocks_per_sm blocks fit (the simulator has no such option).
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, plan.blocks_per_sm)}))
    def gemv_int4(q0, s0, q1, s1, activations, bias_values, out):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        partials = cuda.shared.array(partial_words, float32)
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
        totals = cuda.local.array(slot_scales, float32)
        deferred = cuda.local.array(slot_scales, float32)
        lane = U(cuda.laneid)
        warp = U(U(cuda.threadIdx.x) // U(32))
        warp_id = U(U(U(cuda.blockIdx.x) * U(warps)) + warp)
        block = U(cuda.blockIdx.x)
        if split:
            # This block's run of tiles, then this warp's run of their items (module docstring).
            first_tile = U(U(block * tiles) // blocks)
            block_items = U(U(U(U(U(block + U(1)) * tiles) // blocks) - first_tile) * steps)
            begin = U(U(warp * block_items) // U(warps))
            end = U(U(U(warp + U(1)) * block_items) // U(warps))
            tile0, step0 = U(first_tile + U(begin // steps)), U(begin % steps)
        else:
            # Whole tiles warp_id, warp_id + total_warps, ...: the cursor counts this warp's tiles.
            first_tile, block_items = U(0), U(0)
            count = U(U(U(tiles - U(1) - warp_id) // total_warps) + U(1)) if warp_id < tiles else U(0)
            begin, end = U(0), U(count * steps)
            tile0, step0 = U(0), U(0)
        items = U(end - begin)
        # A tile this warp finishes but did not begin: the warps before it hold its first items.
        deferred_tile = tile0 if step0 != U(0) else U(0xFFFFFFFF)
        # Slot s starts at item begin + s; its (tile, step) cursor then moves `depth` items a round.
        tile1, step1 = advance(tile0, step0, 1)
        tile2, step2 = advance(tile1, step1, 1)
        tile3, step3 = advance(tile2, step2, 1)
        # The weights do not depend on the kernel before this one: request them first, then wait
        # for the activations (ptx/griddep.py).
        load(q0, s0, q1, s1, warp_id, lane, tile0, step0, U(0) < items, words0, scl0)
        if depth >= 2:
            load(q0, s0, q1, s1, warp_id, lane, tile1, step1, U(1) < items, words1, scl1)
        if depth >= 3:
            load(q0, s0, q1, s1, warp_id, lane, tile2, step2, U(2) < items, words2, scl2)
        if depth >= 4:
            load(q0, s0, q1, s1, warp_id, lane, tile3, step3, U(3) < items, words3, scl3)
        grid_dependency_wait()
        stage(activations, xs)
        for i in range(slot_scales):
            acc[i] = float32(0)
            deferred[i] = float32(0)
        item = U(0)
        triggered = False
        while item < items:
            compute(warp_id, lane, tile0, step0, item < items, deferred_tile, words0, scl0, activations, xs, xv, acc,
                    totals, deferred, bias_values, out)
            tile0, step0 = advance(tile0, step0, depth)
            load(q0, s0, q1, s1, warp_id, lane, tile0, step0, U(item + U(depth)) < items, words0, scl0)
            if depth >= 2:
                compute(warp_id, lane, tile1, step1, U(item + U(1)) < items, deferred_tile, words1, scl1, activations, xs,
                        xv, acc, totals, deferred, bias_values, out)
                tile1, step1 = advance(tile1, step1, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile1, step1, U(item + U(depth + 1)) < items, words1, scl1)
            if depth >= 3:
                compute(warp_id, lane, tile2, step2, U(item + U(2)) < items, deferred_tile, words2, scl2, activations, xs,
                        xv, acc, totals, deferred, bias_values, out)
                tile2, step2 = advance(tile2, step2, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile2, step2, U(item + U(depth + 2)) < items, words2, scl2)
            if depth >= 4:
                compute(warp_id, lane, tile3, step3, U(item + U(3)) < items, deferred_tile, words3, scl3, activations, xs,
                        xv, acc, totals, deferred, bias_values, out)
                tile3, step3 = advance(tile3, step3, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile3, step3, U(item + U(depth + 3)) < items, words3, scl3)
            item = U(item + U(depth))
            if not triggered and U(item + U(depth)) >= items:
                # This thread has issued its last load: the next kernel may start and request its
                # weights while this block finishes (a trigger at the start put the next kernel's
                # blocks beside this one's for its whole run, which measured slower).
                launch_dependents()
                triggered = True
        if not triggered:
            launch_dependents()
        if split:
            # A run that ends inside a tile (or is empty) leaves its sums for the warp that finishes
            # that tile; they are added in warp order, so every run sums in the same order.
            if items == U(0) or U(end % steps) != U(0):
                warp_totals(acc, totals)
                if lane == U(0):
                    for i in range(slot_scales):
                        partials[U(U(warp * U(slot_scales)) + U(i))] = totals[i]
            cuda.syncthreads()
            if deferred_tile != U(0xFFFFFFFF) and items != U(0):
                tile_begin = U(U(deferred_tile - first_tile) * steps)
                if U(tile_begin + steps) <= end:  # this warp holds the tile's last step
                    before = warp
                    while True:
                        before = U(before - U(1))
                        for i in range(slot_scales):
                            deferred[i] += partials[U(U(before * U(slot_scales)) + U(i))]
                        if U(U(before * block_items) // U(warps)) <= tile_begin:
                            break
                    finish(deferred_tile, lane, deferred, bias_values, out)

    return gemv_int4
