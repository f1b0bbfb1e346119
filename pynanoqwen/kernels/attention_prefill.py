"""Causal prefill attention over the paged KV cache, on the tensor cores (flash-attention 2 style).

A prompt chunk of m query rows; row i is position start + i and attends to positions 0..start + i:

    out[i, h] = softmax_j(q[i, h] . K[j, h // group] / sqrt(head_dim)) @ V[j, h // group],  j <= start + i

for every query head h (group = num_heads // num_kv_heads query heads share one KV head, GQA).
K and V come from the pages decode reads (docs/DECODE.md): k_pages, v_pages float16 [num_pages,
num_kv_heads, 16, head_dim], position p at page page_table[p // 16], slot p % 16. Positions below
start were written by earlier chunks, start..start + m - 1 by this chunk's rope_kv_write; nothing
else is ever read (other slots may hold anything, NaN included). q float32 [M_cap, num_heads,
head_dim] (rotated), out float16 [M_cap, num_heads * head_dim]. start and m are int32[1] device
arrays, because the launch is captured in a CUDA graph; M_cap (q.shape[0]) fixes the grid then.

Launch shape. grid = (ceil(M_cap / query_tile), num_kv_heads), block = group * query_tile / 16
warps. Block (x, g) serves query positions [r0, r0 + query_tile) for all `group` query heads of KV
head g, so each K/V tile it stages in shared memory feeds every one of those heads (GQA reuse: at
7B one pass over the pages serves 7 heads). The x order is reversed (r0 counts down from the end)
because later rows see more keys: the longest blocks start first. Blocks with r0 >= m exit at once.
Warp w owns one 16-row mma tile: query head g * group + w % group, rows r0 + 16 (w // group)..+15.

Per warp, with lane (gid, tid) = (lane // 4, lane % 4) as in ptx/mma.py:
- Q is loaded once from global memory, scaled by log2(e) / sqrt(head_dim) (scores live in the log2
  domain, so exp2, one `ex2.approx`, gives the weights), rounded to FP16 and kept in registers as
  the A fragments of its head_dim / 16 k steps (32 registers at head_dim 128).
- Keys come in tiles of KEY_TILE = 32 (two pages). S = Q K^T is 16 x 32: 4 n tiles of 8 keys,
  each head_dim / 16 mma steps, the B fragments read with `ldmatrix.x4` straight from the K rows
  (K row-major is B = K^T column-major, which is what the .col operand wants).
- Causal mask (only in tiles that reach past the warp's first position): key > row position -> -inf.
  Online softmax in float32: row max over the quad (2 shuffles), rescale the O accumulators and
  the running sum by exp2(old max - new max), P = exp2(S - max).
- O += P V: the S accumulators of two adjacent key n tiles are exactly the A fragment of one
  16-key mma step (flash-attention 2's register reuse), packed to FP16 with `cvt.rn.f16x2.f32`;
  V's B fragments come from `ldmatrix.x4.trans` of the V rows. O is 16 x head_dim: head_dim / 8
  n tiles, 64 float32 accumulators per lane at head_dim 128.
- The row sums stay per-lane partial sums until the end (one quad reduction), then each lane
  writes its half2 words of the rows below m.
Per key tile a warp issues head_dim / 2 mma (64 at head_dim 128), head_dim / 4 ldmatrix.x4 and
~120 instructions of softmax (the PTX block of softmax + P V: 243 instructions, 32 mma).

Pipeline: two stages of (K tile, V tile) in shared memory, filled with 16-byte `cp.async.cg` by
all threads (page_table is looked up per row). In step kt a thread waits for its copies of tile
kt, one barrier publishes the tile (and tells everyone the other stage is free), then tile kt + 1
is issued and tile kt computed, so the copy of the next tile overlaps this one's mma. Key rows
past the block's last needed position (min(start + r0 + query_tile, start + m) - 1) are zero-
filled by the copy (src-size 0) and never read from global memory: garbage there would otherwise
reach O through 0 * NaN. Rows are padded from head_dim / 2 to head_dim / 2 + 4 words so that the
8 row addresses of one ldmatrix matrix fall in 8 different 16-byte bank groups (no conflicts):
2 x 2 x 32 x 272 B = 34 KiB of shared memory per block at head_dim 128.

Cost model (predicted; the measured times are in docs/PERFORMANCE.md, and
tests/test_attention_prefill_gpu.py prints them).
The causal work at 7B is 4 * head_dim * num_heads * sum_i (start + i + 1) FLOP per layer
(`attention_flops`): 1.9 GFLOP at m = 512, 30 GFLOP at m = 2048, 90 GFLOP for a second 2048-row
chunk (start = 2048), 481 GFLOP for 8192 rows in one pass; the layer's INT4 GEMMs are 0.47 GFLOP
per row (240 GFLOP at m = 512). Per key tile a warp issues 64 mma for 262 kFLOP; if the tensor
cores run at a third of the ~660 TFLOP/s mma.sync peak (7-14 warps per SM, softmax in between)
that is ~18 us at m = 512 (one wave of 128 blocks: the longest, 16 key tiles, sets the time),
~140 us at 2048, ~410 us for the second chunk. K/V traffic: each block reads its KV head's keys 0..last once
(512 B per key at head_dim 128, K + V) from L2 mostly: at query tile 16, ~0.8 GB for the second
2048-row chunk, well under the L2's bandwidth for that time. Registers: 128 (capped, REGISTER_CAP),
shared memory 35 KiB, so two 7-warp blocks share an SM. What it reaches is bench's prefill-attention
table in docs/PERFORMANCE.md (~200 TFLOP/s, a quarter of the bf16 peak, from 8k tokens on).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from ..errors import ConfigError
from ..ptx import SIMULATOR
from ..ptx.half2 import float2_to_half2
from ..ptx.mma import SHARED_ALIGNMENT, cp_async_16, cp_async_commit_group, cp_async_wait_group, \
    ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16
from ..ptx.warp import shfl_xor
from . import PAGE_SIZE, CompileTarget

KEY_TILE = 32  # keys per pipeline stage: two pages, four n tiles of S
STAGES = 2  # (K, V) tiles in shared memory; a third would not fit the 48 KiB of static shared memory
QUERY_TILE = 16  # default query positions per block: one 16-row mma tile per query head
# Registers per thread, so that two 7-warp blocks (7B, query tile 16) fit an SM. Registers are
# split between the SM's four schedulers, 16384 each, and 14 warps put 4 on some of them: 4 x 32 x
# 128 = 16384. At 144 (no spills) only one block fitted, and the kernel ran latency-bound at 7 warps
# a SM; at 128 ptxas spills 72 bytes, and a 32000-token prompt's attention took 36.9 ms a layer
# against 48.3 (1.7% slower at 2048 tokens: docs/PERFORMANCE.md, "Prefill, 2026-12-03 evening").
REGISTER_CAP = 128
JIT_OPTIONS = {} if SIMULATOR else {"max_registers": REGISTER_CAP}  # the simulator takes no such option
U = np.uint32  # unsigned index arithmetic: no negative-index checks


def make_prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, *,
                           query_tile: int = QUERY_TILE) -> "PrefillAttention":
    """Build the prefill-attention kernel for one model's attention shape (dims become constants)."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 32:
        raise ConfigError(f"prefill attention needs head_dim a multiple of 32, got {head_dim}")
    warps = num_heads // num_kv_heads * (query_tile // 16)
    # At ~166 registers a thread, 14 warps (7B, query_tile 32) did not launch on the H200
    # (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: 166 x 448 > 65536 registers); 8 warps always fit.
    if query_tile < 16 or query_tile % 16 or warps > 8:
        raise ConfigError(f"query_tile {query_tile} must be a multiple of 16 giving at most 8 warps "
                          f"({num_heads // num_kv_heads} query heads per KV head)")
    if max_pages < 1:
        raise ConfigError(f"max_pages ({max_pages}) must be positive")
    return PrefillAttention(num_heads, num_kv_heads, head_dim, max_pages, query_tile)


@functools.cache  # one compile per shape a process: every engine it loads (validate loads six) shares it
def _build_kernel(num_heads, num_kv_heads, head_dim, query_tile):
    GROUP = num_heads // num_kv_heads  # query heads per KV head
    ROW_TILES = query_tile // 16  # 16-row mma tiles of positions per block
    THREADS = 32 * GROUP * ROW_TILES
    QUERY_ROWS = query_tile
    ROW_WORDS = head_dim // 2  # one K/V row in global memory, as half2 words
    SMEM_ROW_WORDS = ROW_WORDS + 4  # padded row: ldmatrix's 8 row addresses hit 8 bank groups
    TILE_WORDS = KEY_TILE * SMEM_ROW_WORDS
    RING_WORDS = STAGES * TILE_WORDS
    ROW_CHUNKS = head_dim // 8  # 16-byte copies per row
    TILE_CHUNKS = KEY_TILE * ROW_CHUNKS
    SLOT_WORDS = ROW_WORDS
    KV_HEAD_WORDS = PAGE_SIZE * ROW_WORDS  # one (page, kv head) tile
    PAGE_WORDS = num_kv_heads * KV_HEAD_WORDS
    OUT_ROW_WORDS = num_heads * head_dim // 2
    DIM_STEPS = head_dim // 16  # k steps of Q K^T
    KEY_NTILES = KEY_TILE // 8  # n tiles of S
    KEY_STEPS = KEY_TILE // 16  # k steps of P V
    DIM_NTILES = head_dim // 8  # n tiles of O
    Q_REGISTERS, S_REGISTERS, O_REGISTERS = 4 * DIM_STEPS, 4 * KEY_NTILES, 4 * DIM_NTILES  # per lane
    Q_SCALE = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    ONE = np.float32(1.0)

    @cuda.jit(device=True, inline="always")
    def load_tile(k_words, v_words, page_table, k_ring, v_ring, stage, first_key, last_key, kv_head):
        """Issue this thread's cp.async share of keys first_key..+KEY_TILE-1 (K and V) into `stage`;
        keys past last_key are zero-filled and not read."""
        for i in range(-(-TILE_CHUNKS // THREADS)):
            c = U(cuda.threadIdx.x) + U(i * THREADS)
            if TILE_CHUNKS % THREADS == 0 or c < TILE_CHUNKS:
                row, chunk = c // U(ROW_CHUNKS), c % U(ROW_CHUNKS)
                key = first_key + row
                dst = stage * U(TILE_WORDS) + row * U(SMEM_ROW_WORDS) + chunk * U(4)
                src, size = U(0), U(0)
                if key <= last_key:
                    page = U(page_table[key // U(PAGE_SIZE)])
                    src = page * U(PAGE_WORDS) + kv_head * U(KV_HEAD_WORDS) + (key % U(PAGE_SIZE)) * U(SLOT_WORDS) \
                        + chunk * U(4)
                    size = U(16)
                cp_async_16(k_ring, dst, k_words, src, size)
                cp_async_16(v_ring, dst, v_words, src, size)

    @cuda.jit(**JIT_OPTIONS)
    def prefill_attention(q, k_words, v_words, page_table, start_position, row_count, out_words):
        k_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)
        v_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)

        m = U(row_count[0])
        start = U(start_position[0])
        first_row = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * U(QUERY_ROWS)  # longest blocks first
        if first_row >= m:
            return
        kv_head = U(cuda.blockIdx.y)
        warp, lane = U(cuda.threadIdx.x) // U(32), U(cuda.threadIdx.x) % U(32)
        gid, tid = lane // U(4), lane % U(4)
        head = kv_head * U(GROUP) + warp % U(GROUP)
        warp_row = first_row + U(16) * (warp // U(GROUP))  # this warp's 16 rows start here
        warp_position = start + warp_row
        last_key = start + min(first_row + U(QUERY_ROWS), m) - U(1)  # the block's last needed key
        key_tiles = last_key // U(KEY_TILE) + U(1)

        load_tile(k_words, v_words, page_table, k_ring, v_ring, U(0), U(0), last_key, kv_head)
        cp_async_commit_group()

        # A fragments of Q (pre-scaled, FP16): register 4 kk + half + 2 side holds row gid + 8 half,
        # dims 16 kk + 8 side + 2 tid, +1. Rows >= m are zeros (their q may be anything).
        q_frag = cuda.local.array(Q_REGISTERS, types.uint32)
        for kk in range(DIM_STEPS):
            for half in range(2):
                row = warp_row + gid + U(8 * half)
                for side in range(2):
                    dim = U(16 * kk + 8 * side) + U(2) * tid
                    x0, x1 = ZERO, ZERO
                    if row < m:
                        x0 = q[row, head, dim] * Q_SCALE
                        x1 = q[row, head, dim + U(1)] * Q_SCALE
                    q_frag[4 * kk + half + 2 * side] = float2_to_half2(x0, x1)

        acc = cuda.local.array(O_REGISTERS, types.float32)  # O: c0, c1 row gid; c2, c3 row gid + 8
        for i in range(O_REGISTERS):
            acc[i] = ZERO
        s = cuda.local.array(S_REGISTERS, types.float32)
        max_lo, max_hi = NEG_INF, NEG_INF  # running row maxima (log2 domain) of rows gid, gid + 8
        sum_lo, sum_hi = ZERO, ZERO  # this lane's share of the running row sums

        for kt in range(key_tiles):
            stage = kt % U(STAGES)
            cp_async_wait_group(0)
            # Tile kt is visible to every thread, and every warp is done with tile kt - 1, whose
            # stage is refilled next.
            cuda.syncthreads()
            if kt + U(1) < key_tiles:
                load_tile(k_words, v_words, page_table, k_ring, v_ring, (kt + U(1)) % U(STAGES),
                          (kt + U(1)) * U(KEY_TILE), last_key, kv_head)
            cp_async_commit_group()

            first_key = kt * U(KEY_TILE)
            if first_key > warp_position + U(15):
                continue  # every key of the tile is in the future of every row of this warp
            base = stage * U(TILE_WORDS)

            # S = Q K^T. Lane 8i + r points at key row 8j + r, dims 32 kk2 + 8i: matrices 0, 1 are
            # b0, b1 of k step 2 kk2, matrices 2, 3 those of k step 2 kk2 + 1.
            for j in range(KEY_NTILES):
                c0, c1, c2, c3 = ZERO, ZERO, ZERO, ZERO
                for kk2 in range(DIM_STEPS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(k_ring, base + (U(8 * j) + lane % U(8)) * U(SMEM_ROW_WORDS)
                                                 + U(16 * kk2) + U(4) * (lane // U(8)))
                    a = 8 * kk2
                    c0, c1, c2, c3 = mma_m16n8k16(q_frag[a], q_frag[a + 1], q_frag[a + 2], q_frag[a + 3],
                                                  b0, b1, c0, c1, c2, c3)
                    c0, c1, c2, c3 = mma_m16n8k16(q_frag[a + 4], q_frag[a + 5], q_frag[a + 6], q_frag[a + 7],
                                                  b2, b3, c0, c1, c2, c3)
                s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = c0, c1, c2, c3

            if first_key + U(KEY_TILE - 1) > warp_position:  # the tile reaches past some row's position
                for j in range(KEY_NTILES):
                    for e in range(4):
                        key = first_key + U(8 * j + e % 2) + U(2) * tid
                        if key > warp_position + gid + U(8 * (e // 2)):
                            s[4 * j + e] = NEG_INF

            tile_lo, tile_hi = NEG_INF, NEG_INF
            for j in range(KEY_NTILES):
                tile_lo = max(tile_lo, max(s[4 * j], s[4 * j + 1]))
                tile_hi = max(tile_hi, max(s[4 * j + 2], s[4 * j + 3]))
            for mask in (1, 2):  # the 4 lanes of a quad hold one row's columns
                tile_lo = max(tile_lo, shfl_xor(tile_lo, mask))
                tile_hi = max(tile_hi, shfl_xor(tile_hi, mask))
            # Key 0 is in the first tile and every row may see it, so the maxima are finite from
            # the first tile on, and exp2(-inf - finite) = 0 rescales the empty start away.
            new_lo, new_hi = max(max_lo, tile_lo), max(max_hi, tile_hi)
            scale_lo, scale_hi = math.exp2(max_lo - new_lo), math.exp2(max_hi - new_hi)
            max_lo, max_hi = new_lo, new_hi
            sum_lo *= scale_lo
            sum_hi *= scale_hi
            for j in range(DIM_NTILES):
                acc[4 * j] *= scale_lo
                acc[4 * j + 1] *= scale_lo
                acc[4 * j + 2] *= scale_hi
                acc[4 * j + 3] *= scale_hi
            for j in range(KEY_NTILES):
                s[4 * j] = math.exp2(s[4 * j] - new_lo)
                s[4 * j + 1] = math.exp2(s[4 * j + 1] - new_lo)
                s[4 * j + 2] = math.exp2(s[4 * j + 2] - new_hi)
                s[4 * j + 3] = math.exp2(s[4 * j + 3] - new_hi)
                sum_lo += s[4 * j] + s[4 * j + 1]
                sum_hi += s[4 * j + 2] + s[4 * j + 3]

            # O += P V. The S accumulators of key n tiles 2 ks, 2 ks + 1 are the A fragment of key
            # step ks. Lane 8i + r points at key row 16 ks + 8 (i % 2) + r, dims 16 jp + 8 (i // 2):
            # transposed, matrices 0, 1 are b0, b1 of dim n tile 2 jp, matrices 2, 3 of 2 jp + 1.
            for ks in range(KEY_STEPS):
                p = 8 * ks
                a0 = float2_to_half2(s[p], s[p + 1])
                a1 = float2_to_half2(s[p + 2], s[p + 3])
                a2 = float2_to_half2(s[p + 4], s[p + 5])
                a3 = float2_to_half2(s[p + 6], s[p + 7])
                for jp in range(DIM_NTILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(
                        v_ring, base + (U(16 * ks) + U(8) * ((lane // U(8)) % U(2)) + lane % U(8)) * U(SMEM_ROW_WORDS)
                        + U(8 * jp) + U(4) * (lane // U(16)))
                    o = 8 * jp
                    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                    acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7] = mma_m16n8k16(
                        a0, a1, a2, a3, b2, b3, acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7])

        cp_async_wait_group(0)  # the last (empty) group: nothing of this block is left in flight
        for mask in (1, 2):
            sum_lo += shfl_xor(sum_lo, mask)
            sum_hi += shfl_xor(sum_hi, mask)
        for half in range(2):
            row = warp_row + gid + U(8 * half)
            if row < m:
                inverse = ONE / (sum_lo if half == 0 else sum_hi)
                at = row * U(OUT_ROW_WORDS) + head * U(ROW_WORDS) + tid
                for j in range(DIM_NTILES):
                    out_words[at + U(4 * j)] = float2_to_half2(acc[4 * j + 2 * half] * inverse,
                                                               acc[4 * j + 2 * half + 1] * inverse)

    return prefill_attention


class PrefillAttention:
    """The prefill-attention kernel for one attention shape; nothing is allocated at launch."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, query_tile: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_pages, self.query_tile = max_pages, query_tile
        self.kernel = _build_kernel(num_heads, num_kv_heads, head_dim, query_tile)
        self.block = 32 * (num_heads // num_kv_heads) * (query_tile // 16)

    def launch(self, stream, q, k_pages, v_pages, page_table, start, m, out) -> None:
        """out[i] = causal attention of q[i] (position start[0] + i) for i < m[0]; rows >= m[0] of out
        are left as they were. Every array on the device.

        The caller keeps m[0] <= q.shape[0] and start[0] + m[0] <= max_pages * 16, with every key
        position below start[0] + m[0] already in the pages: the kernel trusts them, as it trusts
        the table.
        """
        m_cap = q.shape[0]
        expected = {"q": (q.shape[1:], (self.num_heads, self.head_dim)),
                    "k_pages": (k_pages.shape[1:], (self.num_kv_heads, PAGE_SIZE, self.head_dim)),
                    "v_pages": (v_pages.shape, k_pages.shape),
                    "page_table": (page_table.shape, (self.max_pages,)),
                    "start": (start.shape, (1,)), "m": (m.shape, (1,)),
                    "out": (out.shape, (m_cap, self.num_heads * self.head_dim))}
        for name, (shape, wanted) in expected.items():
            if tuple(shape) != wanted:
                raise ValueError(f"prefill attention: {name} has shape {tuple(shape)}, expected {wanted}")
        grid = (-(-m_cap // self.query_tile), self.num_kv_heads)
        words = np.uint32
        self.kernel[grid, self.block, stream](q, k_pages.reshape(k_pages.size).view(words),
                                              v_pages.reshape(v_pages.size).view(words), page_table, start, m,
                                              out.reshape(out.size).view(words))


def attention_flops(start: int, m: int, num_heads: int, head_dim: int) -> int:
    """Multiply-adds x 2 of the causal product (Q K^T and P V) for rows start..start + m - 1."""
    keys = m * start + m * (m + 1) // 2
    return 4 * head_dim * num_heads * keys


def compile_targets() -> list[CompileTarget]:
    """The 7B shape (28 q heads over 4 KV heads, head_dim 128) at query tiles 16 and 32, and the
    simulator test's tiny shape."""
    words = types.uint32[::1]
    signature = types.void(types.float32[:, :, ::1], words, words, types.int32[::1], types.int32[::1],
                           types.int32[::1], words)
    must_contain = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                    "cvt.rn.f16x2.f32", "shfl.sync.bfly.b32", "ex2.approx.f32")
    return [CompileTarget(f"prefill_attention[{heads}/{kv_heads}x{head_dim}, query tile {tile}]",
                          _build_kernel(heads, kv_heads, head_dim, tile), signature, must_contain)
            for heads, kv_heads, head_dim, tile in ((28, 4, 128, 16), (28, 4, 128, 32), (4, 2, 32, 16))]
