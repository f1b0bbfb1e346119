"""Decode attention over the paged KV cache: one query token against positions 0..pos.

    attn[h] = softmax_j(q[h] . K[j, h // group] / sqrt(head_dim)) @ V[j, h // group],  j = 0..pos

for every query head h (group = num_heads // num_kv_heads query heads share one KV head, GQA).
Buffers and dtypes are those of docs/DECODE.md: q float32 [num_heads, head_dim] (already rotated);
k_pages, v_pages float16 [num_pages, num_kv_heads, 16, head_dim]; page_table int32; pos int32[1]
(the current token's K/V are already in the cache, so the context is pos + 1 tokens);
attn float16 [num_heads * head_dim].

Launch shape. grid = (num_kv_heads, num_splits), block = (group + 1) warps. Block (g, s) serves
the `group` query heads of KV head g over split s of the context: a contiguous run of
ceil(pages_used / num_splits) pages, possibly none (flash-decoding). num_splits is fixed when
the kernel is built (default: 132 SMs // num_kv_heads, so at 7B 4 x 33 = 132 blocks), because
the launch is frozen in a CUDA graph and must serve every context length 1..max_pages * 16; the
kernel reads pos from device memory and works out its own page range.

Inside a block (warp specialisation):
- the producer warp (the last one; only its lane 0 works) streams this split's pages: for each
  page it waits until ring stage `i % STAGES` is free (`empty` mbarrier), announces 2 tiles of
  bytes on the stage's `full` mbarrier and issues two `cp.async.bulk` copies, the K tile and the
  V tile of (page, g): 16 x head_dim float16 each, 4 KiB at head_dim 128, contiguous in memory.
- consumer warp w computes query head g * group + w; every lane owns 4 of the 128 dimensions
  (dims 64c + 2 * lane + {0, 1} for c = 0, 1), so reading one K or V row is, per c, one 4-byte
  shared load per lane of 32 consecutive words: all 32 banks, no conflict. Per page: 16 scores
  (partial dot per lane, `warp_sum`), an online-softmax update of (max, sum, acc), then the
  weighted sum of the 16 V rows; then every consumer lane arrives on the stage's `empty` barrier
  (count 32 x group), so a stage is refilled only after each lane's own reads, with no syncwarp.
  The ring holds STAGES pages, so the copy engine fetches ahead while the consumers compute.
Scores live in the log2 domain: q is pre-scaled by log2(e) / sqrt(head_dim), so exp2 (one
`ex2.approx` instruction) gives the softmax weights.

Merge. Each split writes its partial (max, sum, unnormalised acc) per head to a workspace the
kernel object owns; then the block increments a per-KV-head counter, and the block that arrives
last (threadfence / atomic / threadfence, as in CUDA's threadFenceReduction sample) merges the
partials of the splits that had pages, writes attn, and resets the counter for the next launch.
That saves a second kernel launch per layer (~1 us each inside a graph, docs/HARDWARE.md).

Shared memory: the ring, STAGES x (K tile + V tile) = 4 x 8 KiB at head_dim 128, plus 2 x STAGES
mbarriers and a flag: 32836 bytes per block (nvJitLink reports 33860 with the 1 KiB sm_90
reserves per block), so up to six blocks fit an SM's 228 KiB.

Cost model (predicted from the PTX, not measured; tests/test_attention_gpu.py prints the real
figures). DRAM: K + V of the context, 2 x ctx x num_kv_heads x head_dim x 2 B: at 7B 1 MiB per
layer at ctx 512 (28 MiB per token, against 3.65 GB of INT4 weights), 8 MiB at 4096, 64 MiB at
32768; at 4.3 TB/s 0.24 us, 2.0 us and 15.6 us. The partials add num_heads x (head_dim + 2) x 4 B
per active split (0.5 MiB with 33 splits, L2-resident). Instruction issue: the consumer's page
loop is ~720 PTX instructions per warp (128 cvt.f32.f16, 64 ld.shared and 64 unpacking movs to
read the two tiles, 128 fma, 80 shfl + 96 add for the 16 warp_sums, 17 ex2), so ~5000 per page
per SM for 7 warps: ~1250 clocks at 4 per clock, ~0.65 us at 1.98 GHz, while a page takes ~0.25 us
to arrive through one SM's 1/132 share of the bandwidth. Long contexts should therefore be
issue-bound at ~2.5x the bandwidth floor (~40 us at ctx 32768), short ones latency-bound (launch,
a DRAM round trip per stage, the merge: a few us). Shared-memory bandwidth is not the limit: each
consumer warp reads every tile, 7 x 8 KiB per page per SM at 128 B per clock is ~450 clocks. If
the GPU confirms this, the levers are a transposed butterfly that reduces the 16 partial dots of
a page with 16 shuffles instead of 80, and warps that serve all query heads of a subset of the
rows, so each K/V element is converted once per block instead of once per consumer warp.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from ..device import sm_count
from ..errors import ConfigError
from ..ptx.bulk_copy import BULK_COPY_ALIGNMENT, bulk_copy_to_shared
from ..ptx.half2 import half2_to_float2
from ..ptx.mbarrier import (fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx,
                            mbarrier_init, mbarrier_wait)
from ..ptx.warp import warp_sum
from . import PAGE_SIZE, CompileTarget

STAGES = 4  # default ring depth: 4 x 8 KiB in flight per SM at head_dim 128


def default_num_splits(num_kv_heads: int) -> int:
    """Splits per KV head so that the grid has about one block per SM of this device."""
    return max(1, sm_count() // num_kv_heads)


def make_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, *,
                          num_splits: int | None = None, stages: int = STAGES) -> "DecodeAttention":
    """Build the decode-attention kernel for one model's attention shape (dims become constants)."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 64:
        raise ConfigError(f"decode attention needs head_dim a multiple of 64, got {head_dim}")
    if num_heads // num_kv_heads > 31:
        raise ConfigError(f"{num_heads // num_kv_heads} query heads per KV head: at most 31 "
                          f"consumer warps fit one block")
    num_splits = default_num_splits(num_kv_heads) if num_splits is None else num_splits
    if min(num_splits, max_pages, stages) < 1:
        raise ConfigError(f"num_splits ({num_splits}), max_pages ({max_pages}) and stages ({stages}) "
                          f"must be positive")
    return DecodeAttention(num_heads, num_kv_heads, head_dim, max_pages, num_splits, stages)


def _build_kernel(num_heads, num_kv_heads, head_dim, num_splits, stages):
    GROUP = num_heads // num_kv_heads  # query heads per KV head = consumer warps per block
    PRODUCER_WARP = GROUP
    CONSUMER_THREADS = 32 * GROUP
    HEAD_DIM = head_dim
    NUM_SPLITS = num_splits
    STAGES = stages
    CHUNKS = head_dim // 64  # a lane owns 2 dims (one half2 word) in each 64-dim chunk of a row
    DIMS_PER_LANE = 2 * CHUNKS
    ROW_WORDS = head_dim // 2  # a K/V row as uint32 words, each holding two float16
    TILE_BYTES = PAGE_SIZE * head_dim * 2  # one (page, kv head) K or V tile, one bulk copy
    Q_SCALE = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)

    @cuda.jit
    def decode_attention(q, k_pages, v_pages, page_table, pos, out,
                         part_max, part_sum, part_acc, arrivals):
        k_ring = cuda.shared.array((STAGES, PAGE_SIZE, ROW_WORDS), types.uint32, alignment=BULK_COPY_ALIGNMENT)
        v_ring = cuda.shared.array((STAGES, PAGE_SIZE, ROW_WORDS), types.uint32, alignment=BULK_COPY_ALIGNMENT)
        full = cuda.shared.array(STAGES, types.uint64)  # stage holds its page's K and V
        empty = cuda.shared.array(STAGES, types.uint64)  # every consumer is done with the stage
        last_block = cuda.shared.array(1, types.int32)

        kv_head = cuda.blockIdx.x
        split = cuda.blockIdx.y
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32

        context = pos[0] + 1
        pages_used = (context + PAGE_SIZE - 1) // PAGE_SIZE
        pages_per_split = (pages_used + NUM_SPLITS - 1) // NUM_SPLITS
        first_page = split * pages_per_split
        num_pages = max(0, min(pages_used - first_page, pages_per_split))

        if cuda.threadIdx.x == 0:
            for stage in range(STAGES):
                mbarrier_init(full, stage, 1)  # the producer's arrive.expect_tx; the copies add bytes
                mbarrier_init(empty, stage, CONSUMER_THREADS)
            fence_barrier_init()
        cuda.syncthreads()

        if warp == PRODUCER_WARP:
            if lane == 0:
                for i in range(num_pages):
                    stage = i % STAGES
                    # Fill number i // STAGES of this stage needs the consumers' release of the
                    # previous fill; on the first round, parity 1 names the phase "before phase 0",
                    # which counts as complete, so the wait falls through.
                    mbarrier_wait(empty, stage, ((i // STAGES) & 1) ^ 1)
                    page = page_table[first_page + i]
                    mbarrier_arrive_expect_tx(full, stage, 2 * TILE_BYTES)
                    bulk_copy_to_shared(k_ring[stage], k_pages[page, kv_head], TILE_BYTES, full, stage)
                    bulk_copy_to_shared(v_ring[stage], v_pages[page, kv_head], TILE_BYTES, full, stage)
        else:
            head = kv_head * GROUP + warp
            q_lane = cuda.local.array(DIMS_PER_LANE, types.float32)
            acc = cuda.local.array(DIMS_PER_LANE, types.float32)
            scores = cuda.local.array(PAGE_SIZE, types.float32)
            for c in range(CHUNKS):
                for e in range(2):
                    q_lane[2 * c + e] = q[head, 64 * c + 2 * lane + e] * Q_SCALE
                    acc[2 * c + e] = ZERO
            running_max = NEG_INF
            running_sum = ZERO

            for i in range(num_pages):
                stage = i % STAGES
                mbarrier_wait(full, stage, (i // STAGES) & 1)
                # Rows past the context (the tail of the last page) hold stale or garbage values,
                # possibly NaN: mask their scores and never touch their V.
                rows = min(PAGE_SIZE, context - (first_page + i) * PAGE_SIZE)

                page_max = NEG_INF
                for row in range(PAGE_SIZE):
                    partial = ZERO
                    for c in range(CHUNKS):
                        k0, k1 = half2_to_float2(k_ring[stage, row, 32 * c + lane])
                        partial += q_lane[2 * c] * k0  # one fma each: a chain, not mul + fma + add
                        partial += q_lane[2 * c + 1] * k1
                    score = warp_sum(partial)
                    scores[row] = score if row < rows else NEG_INF
                    page_max = max(page_max, scores[row])

                new_max = max(running_max, page_max)
                correction = math.exp2(running_max - new_max)  # 0 on the first page (-inf)
                running_sum *= correction
                for d in range(DIMS_PER_LANE):
                    acc[d] *= correction
                for row in range(PAGE_SIZE):
                    if row < rows:
                        weight = math.exp2(scores[row] - new_max)
                        running_sum += weight
                        for c in range(CHUNKS):
                            v0, v1 = half2_to_float2(v_ring[stage, row, 32 * c + lane])
                            acc[2 * c] += weight * v0
                            acc[2 * c + 1] += weight * v1
                running_max = new_max
                mbarrier_arrive(empty, stage)  # this lane has read the stage; it may be refilled

            if num_pages > 0:
                if lane == 0:
                    part_max[head, split] = running_max
                    part_sum[head, split] = running_sum
                for c in range(CHUNKS):
                    for e in range(2):
                        part_acc[head, split, 64 * c + 2 * lane + e] = acc[2 * c + e]

        # Publish the partials GPU-wide, then count this block in; the last of the KV head's
        # blocks to arrive sees every other block's partials.
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == NUM_SPLITS - 1
        cuda.syncthreads()
        if last_block[0] == 0 or warp == PRODUCER_WARP:
            return
        cuda.threadfence()
        if cuda.threadIdx.x == 0:
            arrivals[kv_head] = 0  # every block of this launch has counted; ready for the next

        head = kv_head * GROUP + warp
        active_splits = (pages_used + pages_per_split - 1) // pages_per_split
        merged_max = NEG_INF
        for s in range(active_splits):
            merged_max = max(merged_max, part_max[head, s])
        merged_sum = ZERO
        merged = cuda.local.array(DIMS_PER_LANE, types.float32)
        for d in range(DIMS_PER_LANE):
            merged[d] = ZERO
        for s in range(active_splits):
            weight = math.exp2(part_max[head, s] - merged_max)
            merged_sum += part_sum[head, s] * weight
            for c in range(CHUNKS):
                for e in range(2):
                    merged[2 * c + e] += part_acc[head, s, 64 * c + 2 * lane + e] * weight
        for c in range(CHUNKS):
            for e in range(2):
                out[head * HEAD_DIM + 64 * c + 2 * lane + e] = merged[2 * c + e] / merged_sum

    return decode_attention


class DecodeAttention:
    """The decode-attention kernel for one attention shape, with its split workspace."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int,
                 num_splits: int, stages: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_pages, self.num_splits, self.stages = max_pages, num_splits, stages
        self.kernel = _build_kernel(num_heads, num_kv_heads, head_dim, num_splits, stages)
        self.grid = (num_kv_heads, num_splits)
        self.block = 32 * (num_heads // num_kv_heads + 1)
        self.part_max = cuda.device_array((num_heads, num_splits), np.float32)
        self.part_sum = cuda.device_array((num_heads, num_splits), np.float32)
        self.part_acc = cuda.device_array((num_heads, num_splits, head_dim), np.float32)
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
            if shape != wanted:
                raise ValueError(f"decode attention: {name} has shape {shape}, expected {wanted}")
        self.kernel[self.grid, self.block, stream](q, k_pages, v_pages, page_table, pos, out,
                                                   self.part_max, self.part_sum, self.part_acc,
                                                   self.arrivals)


def compile_targets() -> list[CompileTarget]:
    """The 7B shape (28 q heads over 4 KV heads, head_dim 128, 33 splits) and the simulator test's."""
    pages = types.float16[:, :, :, ::1]
    signature = types.void(types.float32[:, ::1], pages, pages, types.int32[::1], types.int32[::1],
                           types.float16[::1], types.float32[:, ::1], types.float32[:, ::1],
                           types.float32[:, :, ::1], types.int32[::1])
    must_contain = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                    "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                    "shfl.sync.bfly.b32", "ex2.approx.f32")
    return [CompileTarget(f"decode_attention[{heads}/{kv_heads}x{head_dim}, {splits} splits, {stages} stages]",
                          _build_kernel(heads, kv_heads, head_dim, splits, stages), signature, must_contain)
            for heads, kv_heads, head_dim, splits, stages in ((28, 4, 128, 33, STAGES),
                                                              (4, 2, 64, 3, 2))]
