"""Causal prefill attention over the paged KV cache, on the tensor cores (flash-attention 2 style).

A prompt chunk of m query rows; row i is position start + i and attends to positions 0..start + i:

    out[i, h] = softmax_j(q[i, h] . K[j, h // group] / sqrt(head_dim)) @ V[j, h // group],  j <= start + i

for every query head h (group = num_heads // num_kv_heads query heads share one KV head, GQA).
K and V come from the pages decode reads (docs/DECODE.md): k_pages, v_pages float16 [num_pages,
num_kv_heads, 16, head_dim], position p at page page_table[p // 16], slot p % 16, its values in
the order of kernels/kv_layout.py. Positions below start were written by earlier chunks,
start..start + m - 1 by this chunk's rope_kv_write; nothing else is ever read (other slots may
hold anything, NaN included). q float32 [M_cap, num_heads, head_dim] (rotated), out float16
[M_cap, num_heads * head_dim]. start and m are int32[1] device arrays, because the launch is
captured in a CUDA graph; M_cap (q.shape[0]) fixes the grid then.

Launch shape. grid = (ceil(M_cap / query_tile), num_kv_heads), block = group * query_tile / 16
warps padded to whole warpgroups (7 -> 8 at 7B). Block (x, g) serves query positions [r0, r0 +
query_tile) for all `group` query heads of KV head g, so each K/V tile it stages in shared memory
feeds every one of those heads (GQA reuse: at 7B one pass over the pages serves 7 heads). The x
order is reversed (r0 counts down from the end) because later rows see more keys: the longest
blocks start first. Blocks with r0 >= m exit at once. Warp w < group * query_tile / 16 owns one
16-row tile: query head g * group + w % group, rows r0 + 16 (w // group)..+15. A padding warp
takes warp 0's rows and joins its warpgroup's wgmmas, but keeps no record and stores nothing.
(The split form below adds grid z, one block per segment.) This module owns what is computed,
the launch and the split form's records; kernels/attention_prefill_kernels.py builds the kernels.

Per warp, with lane (gid, tid) = (lane // 4, lane % 4) as in ptx/mma.py:
- Q is loaded once from global memory, scaled by log2(e) / sqrt(head_dim) (scores live in the log2
  domain, so exp2, one `ex2.approx`, gives the weights), rounded to FP16 and kept in registers as
  the A fragments of its head_dim / 16 k steps (32 registers at head_dim 128).
- Keys come in tiles of KEY_TILE = 64 (four pages). S = Q K^T on `wgmma`: a warpgroup's four
  warps' 16 x 64 score tiles are one m64n64 product, head_dim / 16 `wgmma.m64n64k16` whose A rows
  are the four warps' Q fragments (registers exactly as mma.sync takes them) and whose B is the K
  tile in shared memory, in the 128-byte-swizzled K-major layout the tensor cores read (ptx/
  wgmma.py). The scores come back in mma.sync's D layout (per warp: 8 n tiles of 8 keys), so the
  rest is per warp. Every warp of a block attends every tile up to the block's last key, since a
  wgmma needs its whole warpgroup: for a warp whose rows all precede a tile, every weight is
  exp2(-inf) = 0 and every rescaling 1 (0 on an empty state), so its state keeps its bits.
- Causal mask (only in tiles that reach past the warp's first position): key > row position -> -inf.
  Online softmax in float32: row max over the quad (2 shuffles), rescale the O accumulators and
  the running sum by exp2(old max - new max), P = exp2(S - max).
- O += P V on `wgmma` too: the S accumulators of two adjacent key n tiles are exactly the A
  fragment of one 16-key step (flash-attention 2's register reuse; wgmma takes register A as
  mma.sync does), packed to FP16 with `cvt.rn.f16x2.f32`, all of them before the first of the
  step's wgmmas. The warpgroup's O is the D of KEY_TILE / 16 `wgmma.m64n{head_dim}k16` with B =
  the V tile read MN-major (ptx/wgmma.py's wgmma_f16_mn): V is staged exactly as K is, so its
  key rows are B's k rows. O is 16 x head_dim a warp, 64 float32 accumulators per lane at
  head_dim 128. A padding warp runs the softmax too, on warp 0's rows, into a state it never
  stores: a branch around it would put the accumulators' writes on a divergent path, and ptxas
  then serializes every wgmma of the kernel (C7520; the compile tests fail on it).
- The row sums stay per-lane partial sums until the end (one quad reduction), then each lane
  writes its half2 words of the rows below m.

Per 64-key tile a warpgroup issues head_dim / 16 wgmma for S (8 at head_dim 128) and 4 for P V,
and each warp the softmax of its 16 x 64 scores; until 2026-12-07 P V was 64 mma.sync and 16
ldmatrix.x4.trans a warp and tile (`python dev/ptx_loop_mix.py "prefill_attention[28/4x128"`
counts the loop: 1082 PTX instructions, 1301 before).

Segments, and the split form. A block walking its keys alone leaves a short chunk over a long
cache (an /infill whose last line changed: 22 rows over 3984 cached keys) with 8 blocks on 132
SMs. So the keys are cut into segments of SEGMENT_KEYS, and every row's softmax state (O, row
sums, row maxima) restarts at each segment and is folded into a running state in segment order:
max = max(max_r, max_s), then x = fma(x_r, exp2(max_r - max), x_s * exp2(max_s - max)) for every
accumulator and sum. The fold is part of what the kernel computes, so two forms give the same bits:
- whole (prefill_attention): a block walks all its segments, the running state in shared memory
  (each lane its own 68 floats, no barrier), the last fold into registers; a block of one segment
  skips the running state, since folding into the empty state is S + 0;
- split (chunks of M_cap <= SPLIT_ROWS): prefill_attention_split runs each (row block, kv head,
  segment) in a block of its own, grid z = the segments of max_pages (blocks past the keys exit),
  and stores the segment's state per lane in `records`; then prefill_attention_merge folds the
  records in segment order with the same expression, each of MERGE_PARTS blocks a quarter of the
  accumulators, in the same lanes, so the quad reduction of the sums is the same too.
A row may see none of a segment's keys (its position lies below the segment while other rows of
its warp are past it); its maximum stays -inf and exp2 is taken relative to 0, so its weights and
scales are 0, never NaN. The prefix cache relies on the sameness: a cached prompt's last rows run
in a small bucket, split, where the cold run computed them in a large one, whole.

Pipeline: two stages of (K tile, V tile) in shared memory, filled with 16-byte `cp.async.cg` by
all threads (page_table is looked up per row). In step kt a thread waits for its copies of tile
kt and makes them visible to the tensor cores (`fence.proxy.async`), one barrier publishes the
tile (and tells everyone the other stage is free), then tile kt + 1 is issued and tile kt
computed, so the copy of the next tile overlaps this one's arithmetic. Key rows past the block's
last needed position (min(start + r0 + query_tile, start + m) - 1) are zero-filled by the copy
(src-size 0) and never read from global memory: garbage there would otherwise reach O through 0 *
NaN. K and V chunk c of key r land at chunk c ^ (r % 8) of its 64-dim slab's 128-byte row (the
swizzle wgmma reads, K-major for K and MN-major for V; the rings start at a 1024-byte boundary),
where the page stores it too (kernels/kv_layout.py), so a copy moves 16 bytes unchanged. All of
it is dynamic shared memory (`shared_bytes`): at head_dim 128, 1 KiB of alignment slack + 2 x 64
x (256 + 256) B of rings = 65 KiB, and for the whole kernel its running state, 8 warps x 32
lanes x 68 floats = 68 KiB.

Cost model (predicted; the measured times are in docs/PERFORMANCE.md, and
tests/test_attention_prefill_gpu.py prints them).
The causal work at 7B is 4 * head_dim * num_heads * sum_i (start + i + 1) FLOP per layer
(`attention_flops`): 1.9 GFLOP at m = 512, 30 GFLOP at m = 2048, 90 GFLOP for a second 2048-row
chunk (start = 2048), 481 GFLOP for 8192 rows in one pass; the layer's INT4 GEMMs are 0.47 GFLOP
per row (240 GFLOP at m = 512). Registers: 255 (REGISTER_CAP; 240 used at 7B, nothing
spilled), so one 8-warp block a SM: latency is hidden by the wgmma running asynchronously and by
the copy ring, not by a second block. K/V traffic: each block reads its KV head's keys 0..last
once (512 B per key at head_dim 128, K + V) from L2 mostly: at query tile 16, ~0.8 GB for the
second 2048-row chunk, well under the L2's bandwidth for that time. Split, a 22-row chunk over
3984 keys runs 64 blocks of at most 8 tiles and a merge that reads 61 KiB of records a (row
block, kv head, segment). Expected: the issue rate, not the tensor pipe, limits it (the
mma.sync kernel before this one, at 16 warps a SM, was issue- and latency-bound at ~200 TFLOP/s;
wgmma took the 32 mma.sync and 16 ldmatrix.x4 of each warp's Q K^T off the issue slots, and now
P V's). What it reaches is bench's prefill-attention table in docs/PERFORMANCE.md (on an H100,
with P V on mma.sync: 95 TFLOP/s at 512 rows, 265-273 from 8k tokens on, against the all-mma.sync
kernel's 52 and 188-201).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from ..errors import ConfigError
from ..launch import launch
from ..ptx.wgmma import SWIZZLE_ATOM_BYTES
from . import PAGE_SIZE, CompileTarget
from .attention_prefill_kernels import KEY_TILE, MERGE_PARTS, QUERY_TILE, SEGMENT_KEYS, SPLIT_ROWS, STAGES, \
    WARPS_PER_GROUP, build_kernels, state_values


def make_prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, *,
                           query_tile: int = QUERY_TILE, segment_keys: int = SEGMENT_KEYS,
                           split_rows: int = SPLIT_ROWS) -> "PrefillAttention":
    """Build the prefill-attention kernels for one model's attention shape (dims become constants).
    Chunks of at most split_rows rows run split (0: never)."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 64:  # the K ring's rows are whole 128-byte swizzle rows
        raise ConfigError(f"prefill attention needs head_dim a multiple of 64, got {head_dim}")
    warps = block_warps(num_heads, num_kv_heads, query_tile)
    # At 255 registers a thread (REGISTER_CAP), 8 warps are what an SM's 65536 registers hold.
    if query_tile < 16 or query_tile % 16 or warps > 8:
        raise ConfigError(f"query_tile {query_tile} must be a multiple of 16 giving at most 8 warps "
                          f"({num_heads // num_kv_heads} query heads per KV head)")
    if segment_keys < KEY_TILE or segment_keys % KEY_TILE:
        raise ConfigError(f"segment_keys ({segment_keys}) must be a positive multiple of {KEY_TILE}")
    if max_pages < 1:
        raise ConfigError(f"max_pages ({max_pages}) must be positive")
    return PrefillAttention(num_heads, num_kv_heads, head_dim, max_pages, query_tile, segment_keys, split_rows)


class PrefillAttention:
    """The prefill-attention kernels for one attention shape; nothing is allocated at launch (the
    split form's records are allocated here)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, query_tile: int,
                 segment_keys: int, split_rows: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_pages, self.query_tile, self.segment_keys = max_pages, query_tile, segment_keys
        self.split_rows = split_rows
        self.max_segments = segment_count(max_pages, segment_keys)
        self.whole, self.split, self.merge = build_kernels(num_heads, num_kv_heads, head_dim, query_tile,
                                                            segment_keys, self.max_segments)
        self.block = 32 * block_warps(num_heads, num_kv_heads, query_tile)
        self.whole_bytes = shared_bytes(num_heads, num_kv_heads, head_dim, query_tile, whole=True)
        self.split_bytes = shared_bytes(num_heads, num_kv_heads, head_dim, query_tile, whole=False)
        self.records = (cuda.device_array(split_records(num_heads, num_kv_heads, head_dim, max_pages, query_tile,
                                                        segment_keys, split_rows), np.float32)
                        if split_rows else None)

    def launch(self, stream, q, k_pages, v_pages, page_table, start, m, out) -> None:
        """out[i] = causal attention of q[i] (position start[0] + i) for i < m[0]; rows >= m[0] of out
        are left as they were. Every array on the device. A chunk of M_cap = q.shape[0] <= split_rows
        rows runs split (two launches), any other whole; the bits are the same either way.

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
        row_blocks = -(-m_cap // self.query_tile)
        words = np.uint32
        k_words, v_words = k_pages.reshape(k_pages.size).view(words), v_pages.reshape(v_pages.size).view(words)
        out_words = out.reshape(out.size).view(words)
        if m_cap <= self.split_rows:
            launch(self.split, (row_blocks, self.num_kv_heads, self.max_segments), self.block, stream,
                   (q, k_words, v_words, page_table, start, m, self.records), self.split_bytes, dependent=False)
            launch(self.merge, (row_blocks, self.num_kv_heads, MERGE_PARTS), self.block, stream,
                   (start, m, self.records, out_words), dependent=False)
        else:
            launch(self.whole, (row_blocks, self.num_kv_heads), self.block, stream,
                   (q, k_words, v_words, page_table, start, m, out_words), self.whole_bytes, dependent=False)


def split_records(num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, query_tile: int = QUERY_TILE,
                  segment_keys: int = SEGMENT_KEYS, split_rows: int = SPLIT_ROWS) -> int:
    """Floats of the split form's records: a lane's state for every (row block, kv head, segment,
    warp that is not padding)."""
    return (-(-split_rows // query_tile) * num_kv_heads * segment_count(max_pages, segment_keys)
            * 32 * (num_heads // num_kv_heads * (query_tile // 16)) * state_values(head_dim))


def block_warps(num_heads: int, num_kv_heads: int, query_tile: int) -> int:
    """Warps of a block: one 16-row tile of positions for each query head of a KV head, padded to
    whole warpgroups."""
    real = num_heads // num_kv_heads * (query_tile // 16)
    return -(-real // WARPS_PER_GROUP) * WARPS_PER_GROUP


def shared_bytes(num_heads: int, num_kv_heads: int, head_dim: int, query_tile: int, whole: bool) -> int:
    """Dynamic shared memory of a block: the K ring's 1024-byte alignment slack, the rings (a K and
    a V tile a stage, KEY_TILE rows of head_dim FP16 each), and for the whole kernel its running
    state."""
    rings = STAGES * 2 * KEY_TILE * head_dim * 2
    running = 4 * 32 * block_warps(num_heads, num_kv_heads, query_tile) * state_values(head_dim) if whole else 0
    return SWIZZLE_ATOM_BYTES + rings + running


def segment_count(max_pages: int, segment_keys: int) -> int:
    """Segments of the longest context the pages hold: the split form's grid z."""
    return -(-max_pages * PAGE_SIZE // segment_keys)


def attention_flops(start: int, m: int, num_heads: int, head_dim: int) -> int:
    """Multiply-adds x 2 of the causal product (Q K^T and P V) for rows start..start + m - 1."""
    keys = m * start + m * (m + 1) // 2
    return 4 * head_dim * num_heads * keys


def compile_targets() -> list[CompileTarget]:
    """The whole, split and merge kernels (sm_90a: wgmma) at the 7B shape (28 q heads over 4 KV
    heads, head_dim 128, 32768 positions) and at the simulator test's tiny one (4 over 2, head_dim
    64, one-tile segments) at query tile 16; the whole kernel at 0.5B's (14 over 2, head_dim 64) and
    at the tiny shape's query tile 32."""
    words, floats, ints = types.uint32[::1], types.float32[::1], types.int32[::1]
    q = types.float32[:, :, ::1]
    whole = types.void(q, words, words, ints, ints, ints, words)
    split = types.void(q, words, words, ints, ints, ints, floats)
    merge = types.void(ints, ints, floats, words)
    targets = []
    for heads, kv_heads, head_dim, tile, pages, segment, forms in ((28, 4, 128, 16, 2048, SEGMENT_KEYS, 3),
                                                                   (14, 2, 64, 16, 2048, SEGMENT_KEYS, 1),
                                                                   (4, 2, 64, 16, 8, KEY_TILE, 3),
                                                                   (4, 2, 64, 32, 8, KEY_TILE, 1)):
        tiles = (f"wgmma.mma_async.sync.aligned.m64n{KEY_TILE}k16.f32.f16.f16",  # S = Q K^T
                 f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.f16.f16",  # O += P V
                 "fence.proxy.async.shared::cta", "cp.async.cg.shared.global", "cvt.rn.f16x2.f32",
                 "shfl.sync.bfly.b32", "ex2.approx.f32")
        kernels = build_kernels(heads, kv_heads, head_dim, tile, segment, segment_count(pages, segment))
        name = f"{heads}/{kv_heads}x{head_dim}, query tile {tile}, {segment}-key segments"
        targets.append(CompileTarget(f"prefill_attention[{name}]", kernels[0], whole, tiles + ("fma.rn.f32",),
                                     cc=(9, 0, "a")))
        if forms == 3:
            targets.append(CompileTarget(f"prefill_attention_split[{name}]", kernels[1], split, tiles,
                                         cc=(9, 0, "a")))
            targets.append(CompileTarget(f"prefill_attention_merge[{name}]", kernels[2], merge,
                                         ("fma.rn.f32", "shfl.sync.bfly.b32", "cvt.rn.f16x2.f32"), cc=(9, 0, "a")))
    return targets
