"""Decode attention over the paged KV cache, on the tensor cores: one query token against 0..pos.

    attn[h] = softmax_j(q[h] . K[j, h // group] / sqrt(head_dim)) @ V[j, h // group],  j = 0..pos

for every query head h (group = num_heads // num_kv_heads query heads share one KV head, GQA).
Buffers and dtypes are those of docs/DECODE.md: q float32 [num_heads, head_dim] (already rotated);
k_pages, v_pages float16 [num_pages, num_kv_heads, 16, head_dim]; page_table int32; pos int32[1]
(the current token's K/V are already in the cache, so the context is pos + 1 tokens);
attn float16 [num_heads * head_dim].

Launch shape. grid = (num_kv_heads, num_splits), block = CONSUMERS + 1 warps (4 + 1). Block (g, s)
serves all `group` query heads of KV head g over split s of the context: a contiguous run of
max(ceil(pages_used / num_splits), min_pages_per_split) pages, possibly none (flash-decoding).
num_splits is fixed when the kernel is built (default: the GPU's SMs // num_kv_heads, 4 x 33 =
132 blocks on an H200), because the launch is frozen in a CUDA graph and must serve every context
length; the kernel reads pos from device memory and works out its own page range.

Why the tensor cores. The group's query heads are the rows of one 16-row mma tile (rows group..7
are zero), so one warp turns a 16-key page into the 16 x 16 scores S = Q K^T with
`mma.sync.m16n8k16` (2 key n tiles x head_dim / 16 k steps) and adds P V for all heads at once
(head_dim / 8 n tiles). Each K/V element is read from shared memory once per block, by
`ldmatrix`, instead of once per query head: the SIMT kernel this replaces spent ~720 instructions
per page per head (a 16-wide warp_sum per key) and ran issue-bound at 2-16% of bandwidth
(docs/PERFORMANCE.md). Precision is that of float32 arithmetic: q (float32, pre-scaled by
log2(e) / sqrt(head_dim), so exp2 gives the weights) and the weights P are each split into an FP16
high part and an FP16 remainder, and both halves go through the mma, whose products are exact and
whose sums are float32; the result is rounded once, to FP16, at the end. The tile's empty rows
8..15 carry q's remainder through S = Q K^T, so one mma takes both of q's parts (D's rows are
independent: the same bits as a second mma, measured on an H100, docs/PERFORMANCE.md); P V keeps
a mma a part of P, since packing it there too adds a float32 rounding a page and saves at most
0.1 us a launch on top of the packed S (H100, docs/PERFORMANCE.md).

Inside a block (warp specialisation):
- the producer warp (the last; its lane 0) streams the split's pages into a ring of STAGES pages:
  for page i it waits until stage i % STAGES is free (`empty` mbarrier), announces the page's
  bytes on the stage's `full` mbarrier and issues two `cp.async.bulk` copies, the K tile and the V
  tile of (page, g), 4 KiB each. Whole tiles, not rows: a version that copied 32 padded 256-byte
  rows per page (to spare ldmatrix its bank conflicts) ran at ~1.8 us a page, bound by the copy
  engine's per-request cost (docs/PERFORMANCE.md). Stored row by row, the 8 rows an ldmatrix
  matrix reads would be 256 bytes apart, an 8-way bank conflict; the pages are stored swizzled
  instead (kernels/kv_layout.py: chunk c of slot s at c ^ (s % 8)), so a whole-tile copy lands
  conflict-free and the consumers' ldmatrix addresses apply the same XOR.
- consumer warp w takes pages w, w + CONSUMERS, ... (STAGES is a multiple of CONSUMERS, so each
  stage serves one consumer, four pages ahead at the defaults): waits for the page's `full` phase,
  zeroes the V rows past the context (the cache holds anything there, NaN included, and P V would
  form 0 * NaN), computes S, masks keys past the context, updates its own online softmax (running max and sum of each head,
  float32), adds P V into its float32 accumulators, and its 32 lanes arrive on the stage's `empty`
  barrier once their ldmatrix reads are done.
- then the consumers' (max, sum, acc) meet in shared memory and the block writes one partial per
  head for its split.
Merge across splits. Each block increments a per-KV-head counter; the block that arrives last
(threadfence / atomic / threadfence, as in CUDA's threadFenceReduction sample) combines the
partials of the splits that had pages in one pass, an online softmax across splits: each thread
owns 8 dims of a head and loads MERGE_UNROLL splits' (max, sum, dims) at once, through L2 with
`ld.global.cg` (other blocks wrote them), so a short context's merge is one round trip. It writes
attn and resets the counter for the next launch. Programmatic dependent launch (ptx/griddep.py):
the barriers, pos, the page table and the copies of the split's first ring of pages go out before
grid_dependency_wait (all older than the QKV GEMV before this kernel, docs/DECODE.md); q and the
page holding pos, whose row the QKV GEMV writes, wait.

Shared memory (dynamic): the ring, 2 x STAGES x 4 KiB (128 KiB at 16 stages, head_dim 128), the
consumers' partials (CONSUMERS x group x (head_dim + 2) floats, 14.4 KiB at 7B): ~143 KiB.

Cost model (predicted; dev/attention_splits.py measures, docs/PERFORMANCE.md has the figures).
DRAM: K + V of the context, 2 x ctx x num_kv_heads x head_dim x 2 B: at 7B 1 MiB per layer at ctx
512, 8 MiB at 4096, 64 MiB at 32768; at 4.3 TB/s 0.24 us, 2.0 us and 15.6 us. Per page a consumer
issues 16 ldmatrix.x4, 48 mma (16 for S, 32 for P V's two parts), ~60 softmax instructions and 32
FMULs of rescaling: a few hundred cycles, while a page takes ~500 cycles to arrive through one
SM's share of the bandwidth, so long contexts are bandwidth-bound. Short ones are latency: one DRAM round
trip for the pages, the partial write, fence and atomic, and one round of merge loads: ~3 us.
Measured (docs/PERFORMANCE.md): a page costs a consumer ~1.3 us, and a short launch 7.1 us at 16
tokens (8.0 at 545), of which the cross-block merge is still the largest part: from the consumers'
partials meeting to attn written, 4.1 us at 545 tokens on an H100, 1.8 of them the split's partial
stored and fenced, where a block without pages fences in 0.5 (the store's round trip, not the
kind of fence: fence.acq_rel or thread 0 alone measured the same). Those figures predate the
swizzled pages (docs/PERFORMANCE.md, "2026-12-06, morning: K/V pages stored swizzled").
Merging in a cluster (dev/attention_cluster_merge.py) saves nothing at 16 tokens and costs 2.7 to
7.8 us more at 512 and 11 to 32 us at 32000, in clusters of 2, 4 or 8 blocks.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from ..device import sm_count
from ..errors import ConfigError
from ..launch import launch
from ..ptx.bulk_copy import bulk_copy_to_shared
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.half2 import float2_to_half2, half2_to_float2
from ..ptx.loads import ld_global_cg_f32, ld_global_cg_v4_f32
from ..ptx.mbarrier import fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, \
    mbarrier_wait
from ..ptx.mma import ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16
from ..ptx.warp import shfl_xor, syncwarp
from . import PAGE_SIZE, CompileTarget
from .kv_layout import SWIZZLE_ROWS, check_head_dim

CONSUMERS = 4  # consumer warps per block
# Pages in the ring: four per consumer. Against two: 36.0 against 38.0 us a launch at 32000 tokens,
# the same to 0.1 us from 16 to 4096 (docs/PERFORMANCE.md).
STAGES = 16
MIN_PAGES_PER_SPLIT = 4  # a split's pages at short contexts: fewer splits, fewer partials to merge
# Split partials whose loads the merge keeps in flight together: 12 covers the 9 active splits of a
# 512-token context (4 pages a split) in one round trip, at 10 floats a split a thread.
MERGE_UNROLL = 12
OCTET = 8  # dims of a head one merging thread owns: two 16-byte loads a split
MAX_GROUP = 8  # query heads per KV head that fit the mma tile's rows 0..7 (Qwen2.5: 5..8)
U = np.uint32


def default_num_splits(num_kv_heads: int, sms: int | None = None) -> int:
    """Splits per KV head so that the grid has about one block per SM (of this GPU, by default)."""
    return max(1, (sm_count() if sms is None else sms) // num_kv_heads)


def make_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, *,
                          num_splits: int | None = None, stages: int = STAGES, consumers: int = CONSUMERS,
                          min_pages_per_split: int = MIN_PAGES_PER_SPLIT) -> "DecodeAttention":
    """Build the decode-attention kernel for one model's attention shape (dims become constants)."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    check_head_dim(head_dim)  # the pages' swizzle (kernels/kv_layout.py) spans 64 dims
    if num_heads // num_kv_heads > MAX_GROUP:
        raise ConfigError(f"{num_heads // num_kv_heads} query heads per KV head: at most {MAX_GROUP} fit "
                          "the decode attention's mma tile")
    num_splits = default_num_splits(num_kv_heads) if num_splits is None else num_splits
    if min(num_splits, max_pages, stages, consumers, min_pages_per_split) < 1:
        raise ConfigError(f"num_splits ({num_splits}), max_pages ({max_pages}), stages ({stages}), consumers "
                          f"({consumers}) and min_pages_per_split ({min_pages_per_split}) must be positive")
    if stages % consumers:
        # Consumer w takes pages w, w + consumers, ...; with stages a multiple of consumers every
        # stage belongs to one consumer, who waits for its fills in order. Otherwise a consumer
        # could wait for a stage's fill n + 1 while fill n is still in flight, and mbarrier
        # parity cannot tell phases n and n + 2 apart (it read a stale page in the simulator).
        raise ConfigError(f"stages ({stages}) must be a multiple of consumers ({consumers})")
    return DecodeAttention(num_heads, num_kv_heads, head_dim, max_pages, num_splits, stages, consumers,
                           min_pages_per_split)


def shared_layout(group: int, head_dim: int, stages: int, consumers: int) -> dict[str, int]:
    """Word offsets of the dynamic shared memory's parts, and its size in bytes ("bytes")."""
    page_words = PAGE_SIZE * head_dim // 2
    ring = stages * page_words
    layout = {"k_ring": 0, "v_ring": ring, "partial_acc": 2 * ring}
    layout["partial_max"] = layout["partial_acc"] + consumers * group * head_dim
    layout["partial_sum"] = layout["partial_max"] + consumers * group
    layout["bytes"] = 4 * (layout["partial_sum"] + consumers * group)
    return layout


@functools.cache  # one compile per shape a process: every engine it loads (validate loads six) shares it
def _build_kernel(num_heads, num_kv_heads, head_dim, num_splits, stages, consumers, min_pages_per_split):
    GROUP = num_heads // num_kv_heads
    WARPS = consumers + 1
    PRODUCER_WARP = consumers
    THREADS = 32 * WARPS
    ROW_WORDS = SMEM_ROW_WORDS = head_dim // 2
    PAGE_WORDS = PAGE_SIZE * ROW_WORDS
    PAGE_BYTES = 4 * PAGE_WORDS  # one (page, kv head) K or V tile: 4 KiB at head_dim 128
    DIM_STEPS = head_dim // 16  # k steps of Q K^T
    DIM_NTILES = head_dim // 8  # n tiles of O
    DIM_OCTETS = head_dim // OCTET  # the merge's work items a head
    Q_WORDS, O_FLOATS = 2 * DIM_STEPS, 2 * DIM_NTILES  # per lane: Q's A fragments (row gid), O's row gid
    layout = shared_layout(GROUP, head_dim, stages, consumers)
    K_RING, V_RING = layout["k_ring"], layout["v_ring"]
    P_ACC, P_MAX, P_SUM = layout["partial_acc"], layout["partial_max"], layout["partial_sum"]
    Q_SCALE = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    NONE = U(0)  # a zero half2: the A rows 8..15 of P V's mma (no query head there)

    @cuda.jit(device=True, inline="always")
    def split_hi_lo(x0, x1):
        """(half2 of (x0, x1), half2 of what FP16 rounding left out): x = hi + lo to ~2^-22."""
        hi = float2_to_half2(x0, x1)
        h0, h1 = half2_to_float2(hi)
        return hi, float2_to_half2(x0 - h0, x1 - h1)

    @cuda.jit(device=True, inline="always")
    def fill_stage(words, full, empty, pages_ahead, k_pages, v_pages, page_table, kv_head, first_page, num_pages, i,
                   lane):
        """The producer warp's page i of its split: copy its K and V tiles into stage i % stages."""
        if i % 32 == 0:
            # The next 32 page-table entries, one load per lane, through shared memory: a load per
            # page would put an L2 round trip between every two pages' copies.
            entry = page_table[first_page + i + lane] if i + lane < num_pages else 0
            syncwarp()  # lane 0 is done with the previous 32
            pages_ahead[lane] = entry
            syncwarp()
        if lane == 0:
            stage = i % stages
            # Fill i // stages of this stage needs its consumer's release of the previous fill; on
            # the first round parity 1 names the phase before phase 0, complete.
            mbarrier_wait(empty, stage, ((i // stages) & 1) ^ 1)
            page = pages_ahead[i % 32]
            mbarrier_arrive_expect_tx(full, stage, 2 * PAGE_BYTES)
            at = stage * PAGE_WORDS
            bulk_copy_to_shared(words[K_RING + at:K_RING + at + PAGE_WORDS], k_pages[page, kv_head], PAGE_BYTES,
                                full, stage)
            bulk_copy_to_shared(words[V_RING + at:V_RING + at + PAGE_WORDS], v_pages[page, kv_head], PAGE_BYTES,
                                full, stage)

    @cuda.jit
    def decode_attention(q, k_pages, v_pages, page_table, pos, out, part_max, part_sum, part_acc, arrivals):
        full = cuda.shared.array(stages, types.uint64)  # stage holds its page's K and V
        empty = cuda.shared.array(stages, types.uint64)  # its consumer is done with the stage
        last_block = cuda.shared.array(1, types.int32)
        pages_ahead = cuda.shared.array(32, types.int32)  # the producer's next 32 page-table entries
        words = cuda.shared.array(0, types.uint32)  # the K and V rings (dynamic shared memory)
        floats = cuda.shared.array(0, types.float32)  # the same memory: partials past the rings

        kv_head = cuda.blockIdx.x
        split = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        gid, tq = lane // 4, lane % 4

        if tid == 0:
            for stage in range(stages):
                mbarrier_init(full, stage, 1)  # the producer's arrive.expect_tx; the copies add bytes
                mbarrier_init(empty, stage, 32)  # one consumer warp's lanes
            fence_barrier_init()
        cuda.syncthreads()

        # pos, the page table and the K/V of every position before pos are older than the kernel
        # before this one (the QKV GEMV), which lets this one start only after its own
        # grid_dependency_wait: all kernels before it have completed (docs/DECODE.md). So they are
        # read, and the earlier pages requested, before this kernel waits for q and the K/V row
        # of pos, which the QKV GEMV writes into the context's last page.
        context = pos[0] + 1
        pages_used = (context + PAGE_SIZE - 1) // PAGE_SIZE
        pages_per_split = max((pages_used + num_splits - 1) // num_splits, min_pages_per_split)
        first_page = split * pages_per_split
        num_pages = max(0, min(pages_used - first_page, pages_per_split))
        early = min(num_pages, stages)  # the first round of the ring needs no consumer's release
        if 0 < num_pages <= stages and first_page + num_pages == pages_used:
            early = num_pages - 1  # this split ends with the page being written now: not before the wait

        if warp == PRODUCER_WARP:
            for i in range(early):
                fill_stage(words, full, empty, pages_ahead, k_pages, v_pages, page_table, kv_head, first_page,
                           num_pages, i, lane)
        grid_dependency_wait()  # q and the K/V row of pos come from the kernel before (launch.py)

        if warp == PRODUCER_WARP:
            for i in range(early, num_pages):
                fill_stage(words, full, empty, pages_ahead, k_pages, v_pages, page_table, kv_head, first_page,
                           num_pages, i, lane)
        else:
            # A fragments of Q, row gid = query head kv_head * GROUP + gid, k step kk: register
            # 2 kk + side holds dims 16 kk + 8 side + 2 tq, +1; q_lo goes in as rows gid + 8.
            head = kv_head * GROUP + gid
            q_hi = cuda.local.array(Q_WORDS, types.uint32)
            q_lo = cuda.local.array(Q_WORDS, types.uint32)
            for kk in range(DIM_STEPS):
                for side in range(2):
                    dim = 16 * kk + 8 * side + 2 * tq
                    x0, x1 = ZERO, ZERO
                    if gid < GROUP:
                        x0 = q[head, dim] * Q_SCALE
                        x1 = q[head, dim + 1] * Q_SCALE
                    q_hi[2 * kk + side], q_lo[2 * kk + side] = split_hi_lo(x0, x1)
            acc = cuda.local.array(O_FLOATS, types.float32)  # O row gid: dims 8 j + 2 tq, +1
            for d in range(O_FLOATS):
                acc[d] = ZERO
            s = cuda.local.array(4, types.float32)  # S row gid: keys 8 j + 2 tq, +1 of n tile j
            running_max, running_sum = NEG_INF, ZERO  # this lane's share of the sum until the end

            i = warp
            while i < num_pages:
                stage = i % stages
                mbarrier_wait(full, stage, (i // stages) & 1)
                base = stage * PAGE_WORDS
                valid = context - (first_page + i) * PAGE_SIZE  # keys of this page inside the context
                if valid < PAGE_SIZE:
                    # Past the context the cache holds anything, NaN included, and P V would form
                    # 0 * NaN: those V rows become zeros (this warp owns the stage until it releases it).
                    for w in range(lane, (PAGE_SIZE - valid) * ROW_WORDS, 32):
                        words[V_RING + base + valid * ROW_WORDS + w] = U(0)
                    syncwarp()
                # S = Q K^T. Lane 8m + r points at key row 8 j + r, dims 32 kk2 + 8 m (chunk 4 kk2 + m,
                # stored at that ^ r: kernels/kv_layout.py): matrices 0, 1 are b0, b1 of k step
                # 2 kk2, matrices 2, 3 those of k step 2 kk2 + 1.
                for j in range(2):
                    # q's high part in A rows gid, its remainder in rows gid + 8: one mma chain whose D
                    # rows gid (c0, c1) are the high part's sums and rows gid + 8 (d0, d1) the
                    # remainder's, summed at the end. A row of D depends on its own row of A alone, so
                    # this has the bits of two chains, one a part, at half the mma.
                    c0, c1, d0, d1 = ZERO, ZERO, ZERO, ZERO
                    for kk2 in range(DIM_STEPS // 2):
                        b0, b1, b2, b3 = ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS
                                                     + 4 * ((4 * kk2 + lane // 8) ^ (lane % SWIZZLE_ROWS)))
                        a = 4 * kk2
                        c0, c1, d0, d1 = mma_m16n8k16(q_hi[a], q_lo[a], q_hi[a + 1], q_lo[a + 1], b0, b1, c0, c1,
                                                      d0, d1)
                        c0, c1, d0, d1 = mma_m16n8k16(q_hi[a + 2], q_lo[a + 2], q_hi[a + 3], q_lo[a + 3], b2, b3,
                                                      c0, c1, d0, d1)
                    s[2 * j], s[2 * j + 1] = c0 + d0, c1 + d1
                # Keys past the context (the tail of the last page): scores -inf, weights 0.
                if valid < PAGE_SIZE:
                    for e in range(4):
                        if 8 * (e // 2) + 2 * tq + e % 2 >= valid:
                            s[e] = NEG_INF
                page_max = max(max(s[0], s[1]), max(s[2], s[3]))
                page_max = max(page_max, shfl_xor(page_max, 1))  # the 4 lanes of a quad hold one row
                page_max = max(page_max, shfl_xor(page_max, 2))
                new_max = max(running_max, page_max)
                correction = math.exp2(running_max - new_max)  # 0 on the first page (-inf)
                running_max = new_max
                running_sum *= correction
                for d in range(O_FLOATS):
                    acc[d] *= correction
                for e in range(4):
                    s[e] = math.exp2(s[e] - new_max)
                    running_sum += s[e]
                # O += P V: the S accumulators of the two key n tiles are the A fragment of one
                # 16-key k step (rows gid + 8 zero). Lane 8m + r points at key row 8 (m % 2) + r,
                # dims 16 jp + 8 (m // 2) (chunk 2 jp + m // 2, stored at that ^ r): transposed,
                # matrices 0, 1 are b0, b1 of dim n tile 2 jp, matrices 2, 3 those of n tile 2 jp + 1.
                p0_hi, p0_lo = split_hi_lo(s[0], s[1])
                p1_hi, p1_lo = split_hi_lo(s[2], s[3])
                for jp in range(DIM_NTILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(words, V_RING + base + (8 * ((lane // 8) % 2) + lane % 8)
                                                       * SMEM_ROW_WORDS
                                                       + 4 * ((2 * jp + lane // 16) ^ (lane % SWIZZLE_ROWS)))
                    o = 4 * jp
                    acc[o], acc[o + 1], _, _ = mma_m16n8k16(p0_hi, NONE, p1_hi, NONE, b0, b1, acc[o], acc[o + 1],
                                                            ZERO, ZERO)
                    acc[o], acc[o + 1], _, _ = mma_m16n8k16(p0_lo, NONE, p1_lo, NONE, b0, b1, acc[o], acc[o + 1],
                                                            ZERO, ZERO)
                    acc[o + 2], acc[o + 3], _, _ = mma_m16n8k16(p0_hi, NONE, p1_hi, NONE, b2, b3, acc[o + 2],
                                                                acc[o + 3], ZERO, ZERO)
                    acc[o + 2], acc[o + 3], _, _ = mma_m16n8k16(p0_lo, NONE, p1_lo, NONE, b2, b3, acc[o + 2],
                                                                acc[o + 3], ZERO, ZERO)
                mbarrier_arrive(empty, stage)  # this lane's reads of the stage are done
                i += consumers

            running_sum += shfl_xor(running_sum, 1)
            running_sum += shfl_xor(running_sum, 2)
            if gid < GROUP:
                slot = warp * GROUP + gid
                for j in range(DIM_NTILES):
                    for e in range(2):
                        floats[P_ACC + slot * head_dim + 8 * j + 2 * tq + e] = acc[2 * j + e]
                if tq == 0:
                    floats[P_MAX + slot] = running_max
                    floats[P_SUM + slot] = running_sum
        launch_dependents()
        cuda.syncthreads()

        # This split's partial per head: the consumers' (max, sum, acc) rescaled to their common max.
        # A consumer without pages has max -inf: weight 0. Each head's consumer weights are worked
        # out once, by one thread a head, into the max slots they came from; then every dim takes
        # them with independent loads. (Worked out again for every dim instead, each thread's ~6
        # dims were ~6 chains of dependent shared loads and exp2s: 0.5 us more from the partials
        # meeting to their stores fenced, docs/PERFORMANCE.md.) num_pages is the block's own, so
        # every thread of the block reaches the barrier or none does.
        if num_pages > 0:
            if tid < GROUP:
                merged_max = NEG_INF
                for w in range(consumers):
                    merged_max = max(merged_max, floats[P_MAX + w * GROUP + tid])
                total = ZERO
                for w in range(consumers):
                    weight = math.exp2(floats[P_MAX + w * GROUP + tid] - merged_max)
                    floats[P_MAX + w * GROUP + tid] = weight
                    total += floats[P_SUM + w * GROUP + tid] * weight
                slot = (kv_head * GROUP + tid) * num_splits + split
                part_max[slot] = merged_max
                part_sum[slot] = total
            cuda.syncthreads()
            for o in range(tid, GROUP * head_dim, THREADS):
                row, dim = o // head_dim, o % head_dim
                value = ZERO
                for w in range(consumers):
                    value += floats[P_ACC + (w * GROUP + row) * head_dim + dim] * floats[P_MAX + w * GROUP + row]
                part_acc[((kv_head * GROUP + row) * num_splits + split) * head_dim + dim] = value

        # Publish the partials GPU-wide, then count this block in; the last of the KV head's
        # blocks to arrive sees every other block's partials.
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == num_splits - 1
        cuda.syncthreads()
        if last_block[0] == 0:
            return
        cuda.threadfence()
        if tid == 0:
            arrivals[kv_head] = 0  # every block of this launch has counted; ready for the next

        # One pass over the active splits: each thread owns OCTET dims of one head and, per batch of
        # MERGE_UNROLL splits, issues every load of the batch (max, sum and its dims of the partial)
        # at once, then folds the batch into a running (max, sum, acc) with the online softmax's
        # rescaling. One L2 round trip a batch; the two-pass merge it replaces (maxima and sums to
        # shared memory, the splits' weights, then the partials) paid two and two block barriers.
        active = (pages_used + pages_per_split - 1) // pages_per_split
        maxes = cuda.local.array(MERGE_UNROLL, types.float32)
        sums = cuda.local.array(MERGE_UNROLL, types.float32)
        values = cuda.local.array((MERGE_UNROLL, OCTET), types.float32)
        merged = cuda.local.array(OCTET, types.float32)
        for o in range(tid, GROUP * DIM_OCTETS, THREADS):
            row, octet = o // DIM_OCTETS, o % DIM_OCTETS
            head = kv_head * GROUP + row
            for e in range(OCTET):
                merged[e] = ZERO
            merged_max, merged_sum = NEG_INF, ZERO
            for first in range(0, active, MERGE_UNROLL):
                for u in range(MERGE_UNROLL):
                    # Past the end: re-read the last split (finite values) with max -inf, weight 0.
                    sp = min(first + u, active - 1)
                    slot = head * num_splits + sp
                    maxes[u] = ld_global_cg_f32(part_max, slot) if first + u < active else NEG_INF
                    sums[u] = ld_global_cg_f32(part_sum, slot)
                    for half in range(OCTET // 4):
                        at = slot * head_dim + OCTET * octet + 4 * half
                        (values[u, 4 * half], values[u, 4 * half + 1], values[u, 4 * half + 2],
                         values[u, 4 * half + 3]) = ld_global_cg_v4_f32(part_acc, at)
                batch_max = merged_max
                for u in range(MERGE_UNROLL):
                    batch_max = max(batch_max, maxes[u])
                # An active split's max is finite (it had a key in the context), so batch_max is too.
                correction = math.exp2(merged_max - batch_max)  # 0 on the first batch (-inf)
                merged_max = batch_max
                merged_sum *= correction
                for e in range(OCTET):
                    merged[e] *= correction
                for u in range(MERGE_UNROLL):
                    weight = math.exp2(maxes[u] - batch_max)
                    merged_sum += sums[u] * weight
                    for e in range(OCTET):
                        merged[e] += values[u, e] * weight
            inverse = np.float32(1.0) / merged_sum
            for e in range(OCTET):
                out[head * head_dim + OCTET * octet + e] = merged[e] * inverse

    return decode_attention


class DecodeAttention:
    """The decode-attention kernel for one attention shape, with its split workspace."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, num_splits: int,
                 stages: int, consumers: int, min_pages_per_split: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_pages, self.num_splits, self.stages = max_pages, num_splits, stages
        self.kernel = _build_kernel(num_heads, num_kv_heads, head_dim, num_splits, stages, consumers,
                                    min_pages_per_split)
        self.grid = (num_kv_heads, num_splits)
        self.block = 32 * (consumers + 1)
        self.shared_bytes = shared_layout(num_heads // num_kv_heads, head_dim, stages,
                                          consumers)["bytes"]
        self.part_max = cuda.device_array(num_heads * num_splits, np.float32)
        self.part_sum = cuda.device_array(num_heads * num_splits, np.float32)
        self.part_acc = cuda.device_array(num_heads * num_splits * head_dim, np.float32)
        self.arrivals = cuda.to_device(np.zeros(num_kv_heads, np.int32))  # the kernel resets it

    def launch(self, stream, q, k_pages, v_pages, page_table, pos, out) -> None:
        """attn `out` of the token at position pos[0]; every array on the device; no allocation.

        The caller keeps pos[0] < max_pages * 16: the kernel trusts it, as it trusts the table.
        """
        expected = {"q": (q.shape, (self.num_heads, self.head_dim)),
                    "k_pages": (k_pages.shape[1:], (self.num_kv_heads, PAGE_SIZE, self.head_dim)),
                    "v_pages": (v_pages.shape, k_pages.shape),
                    "page_table": (page_table.shape, (self.max_pages,)),
                    "out": (out.shape, (self.num_heads * self.head_dim,))}
        for name, (shape, wanted) in expected.items():
            if tuple(shape) != wanted:
                raise ValueError(f"decode attention: {name} has shape {tuple(shape)}, expected {wanted}")
        launch(self.kernel, self.grid, self.block, stream,
               (q, k_pages, v_pages, page_table, pos, out, self.part_max, self.part_sum, self.part_acc,
                self.arrivals), shared_bytes=self.shared_bytes)


def compile_targets() -> list[CompileTarget]:
    """The 7B shape (28 q heads over 4 KV heads, head_dim 128, 33 splits) and the simulator test's."""
    pages = types.float16[:, :, :, ::1]
    flat = types.float32[::1]
    signature = types.void(types.float32[:, ::1], pages, pages, types.int32[::1], types.int32[::1],
                           types.float16[::1], flat, flat, flat, types.int32[::1])
    must_contain = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                    "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ld.global.cg.v4.f32", "ex2.approx.f32",
                    "griddepcontrol.wait")
    return [CompileTarget(f"decode_attention[{heads}/{kv_heads}x{head_dim}, {splits} splits]",
                          _build_kernel(heads, kv_heads, head_dim, splits, STAGES, CONSUMERS, MIN_PAGES_PER_SPLIT),
                          signature, must_contain)
            for heads, kv_heads, head_dim, splits in ((28, 4, 128, default_num_splits(4, 132)), (4, 2, 64, 3))]
