"""A candidate replacement of kernels/attention_prefill_kernels.py, written as edits of it (harness.
edited_kernel_source: a change of the product that moves an anchor stops this script): the
product's whole, split and merge kernels (segments, folds and records unchanged) with Q K^T on wgmma, as
dev/attention_prefill_wgmma.py measured it fastest (64 keys a tile, 255 registers; docs/PERFORMANCE.md,
"Prefill attention on wgmma, measured"). What changes against the product:

- a block's warps are whole warpgroups: the GQA group's warps (a query head and a 16-row tile
  each) padded to a multiple of 4; a padding warp copies a real warp's Q, joins its warpgroup's
  wgmmas and does nothing else (no state, no record, no store);
- key tiles of 64 (four pages); K lands in the 128-byte-swizzled K-major layout the tensor cores
  read (chunk c of row r at c ^ (r % 8) of its 64-wide slab), V padded as the product pads it;
- S = Q K^T: head_dim / 16 `wgmma` m64n64k16 a warpgroup, the A rows its 4 warps' Q fragments,
  the accumulators in mma.sync's D layout, so the masking, the online softmax, P V and every fold
  are the product's code;
- a tile is skipped only when it lies in the future of every row of the block (a wgmma needs its
  whole warpgroup); for a warp whose rows all precede it, attending it is exact: every weight is
  exp2(-inf) = 0, each scale 1 (or 0 on an empty state), so its state keeps its bits;
- the rings (and the whole kernel's running state) are dynamic shared memory, the K ring at a
  1024-byte boundary: 67 KiB at 7B, 2 x 64 x (256 + 272) bytes.
The simulator test (tests/sim/test_attention_prefill_kernels_wgmma_sim.py) checks both forms
against float64 and the split form's bits against the whole form's, as the product's test does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda, types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import edited_kernel_source, load_source  # noqa: E402
from pynanoqwen.kernels import PAGE_SIZE, CompileTarget  # noqa: E402
from pynanoqwen.kernels.attention_prefill import PrefillAttention, segment_count, split_records  # noqa: E402
from pynanoqwen.launch import launch  # noqa: E402
from pynanoqwen.ptx.wgmma import SWIZZLE_ATOM_BYTES, WARPGROUP  # noqa: E402

HEADER = """from pynanoqwen.kernels.call_free import divide
from pynanoqwen.ptx.wgmma import ROW_BYTES, SWIZZLE_ATOM_BYTES, fence_proxy_async_shared, shared_byte_address, \\
    wgmma_commit_group, wgmma_f16, wgmma_fence, wgmma_wait_group
"""
D = '    @cuda.jit(device=True, inline="always")\n'
EDITS = [
    ("KEY_TILE = 32  # keys per pipeline stage: two pages, four n tiles of S",
     "KEY_TILE = 64  # keys per pipeline stage: four pages, one m64n64 wgmma a 16-dim k step"),
    # One block a SM, nothing spilled: at 128 registers (two blocks a SM) dev/attention_prefill_wgmma.py's
    # 64-key form spilled 376 bytes and was its slowest setting.
    ("REGISTER_CAP = 128\n", "REGISTER_CAP = 255\n"),
    ("    WARPS = GROUP * ROW_TILES\n",
     "    REAL_WARPS = GROUP * ROW_TILES\n    WARPS = -(-REAL_WARPS // 4) * 4  # whole warpgroups\n"),
    ("""    SMEM_ROW_WORDS = ROW_WORDS + 4  # padded row: ldmatrix's 8 row addresses hit 8 bank groups
    TILE_WORDS = KEY_TILE * SMEM_ROW_WORDS
    RING_WORDS = STAGES * TILE_WORDS
""", """    V_ROW_WORDS = ROW_WORDS + 4  # padded V row: ldmatrix's 8 row addresses hit 8 bank groups
    K_TILE_WORDS = KEY_TILE * ROW_WORDS  # swizzled, unpadded: 64-wide slabs of KEY_TILE 128-byte rows
    SLAB_WORDS = KEY_TILE * ROW_BYTES // 4
    V_TILE_WORDS = KEY_TILE * V_ROW_WORDS
    RINGS_WORDS = STAGES * (K_TILE_WORDS + V_TILE_WORDS)
"""),
    ("v_ring, base + (U(16 * ks) + U(8) * ((lane // U(8)) % U(2)) + lane % U(8)) * U(SMEM_ROW_WORDS)",
     "smem, v_stage + (U(16 * ks) + U(8) * ((lane // U(8)) % U(2)) + lane % U(8)) * U(V_ROW_WORDS)"),
    ("""    def walk_tiles(k_words, v_words, page_table, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, lane, gid, tid, q_frag, s, state, running, run_at):""",
     """    def walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, lane, gid, tid, q_frag, s, state, running, run_at, real):"""),
    ("inverse = ONE / (sum_lo if half == 0 else sum_hi)",
     "inverse = divide(ONE, sum_lo if half == 0 else sum_hi)  # no call: kernels/call_free.py"),
    # The whole kernel: rings and running state in dynamic shared memory; padding warps keep no state.
    ("""        k_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)
        v_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)
        running = cuda.shared.array(0, types.float32)  # dynamic: WARPS x STATE x 32 lanes
""", """        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings, then WARPS x STATE x 32 floats
        running = cuda.shared.array(0, types.float32)  # the same memory
        k_ring, v_ring = rings(smem)
"""),
    ("""        warp, lane, gid, tid, head, warp_row, warp_position = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, k_ring, v_ring, U(0), U(0), last_key, kv_head)""",
     """        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), U(0), last_key, kv_head)"""),
    ("        run_at = warp * U(STATE * 32) + lane", "        run_at = k_ring + U(RINGS_WORDS) + warp * U(STATE * 32) + lane"),
    ("        if not single:\n", "        if not single and real:\n"),
    ("""        walk_tiles(k_words, v_words, page_table, k_ring, v_ring, U(0), key_tiles, last_key, kv_head, warp_position,
                   lane, gid, tid, q_frag, s, state, running, run_at)
""", """        walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), key_tiles, last_key, kv_head,
                   warp_position, lane, gid, tid, q_frag, s, state, running, run_at, real)
        if not real:
            return
"""),
    # The split kernel.
    ("""        k_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)
        v_ring = cuda.shared.array(RING_WORDS, types.uint32, alignment=SHARED_ALIGNMENT)
        unused = cuda.shared.array(1, types.float32)  # walk_tiles' running state: one segment never folds
""", """        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings
        unused = cuda.shared.array(1, types.float32)  # walk_tiles' running state: one segment never folds
        k_ring, v_ring = rings(smem)
"""),
    ("""        warp, lane, gid, tid, head, warp_row, warp_position = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, k_ring, v_ring, first_tile % U(STAGES), first_tile * U(KEY_TILE),""",
     """        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile % U(STAGES), first_tile * U(KEY_TILE),"""),
    ("""        walk_tiles(k_words, v_words, page_table, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, lane, gid, tid, q_frag, s, state, unused, U(0))
""", """        walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, lane, gid, tid, q_frag, s, state, unused, U(0), real)
        if not real:
            return
"""),
    # The merge: padding warps have no records.
    ("""        warp, lane, gid, tid, head, warp_row, warp_position = lane_rows(first_row, start)
        part = U(cuda.blockIdx.z)""", """        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        if not real:
            return
        part = U(cuda.blockIdx.z)"""),
]
SECTIONS = [
    (D + "    def load_tile(", D + "    def load_q(", r'''    @cuda.jit(device=True, inline="always")
    def load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, stage, first_key, last_key, kv_head):
        """Issue this thread's cp.async share of keys first_key..+KEY_TILE-1 into `stage`: K chunk c
        of row r at chunk position c ^ (r % 8) of its slab's 128-byte row, V padded. Keys past
        last_key are zero-filled and not read."""
        for i in range(-(-TILE_CHUNKS // THREADS)):
            c = U(cuda.threadIdx.x) + U(i * THREADS)
            if TILE_CHUNKS % THREADS == 0 or c < TILE_CHUNKS:
                row, chunk = c // U(ROW_CHUNKS), c % U(ROW_CHUNKS)
                key = first_key + row
                k_dst = (k_ring + stage * U(K_TILE_WORDS) + (chunk // U(8)) * U(SLAB_WORDS) + row * U(32)
                         + U(4) * ((chunk % U(8)) ^ (row % U(8))))
                v_dst = v_ring + stage * U(V_TILE_WORDS) + row * U(V_ROW_WORDS) + chunk * U(4)
                src, size = U(0), U(0)
                if key <= last_key:
                    page = U(page_table[key // U(PAGE_SIZE)])
                    src = page * U(PAGE_WORDS) + kv_head * U(KV_HEAD_WORDS) + (key % U(PAGE_SIZE)) * U(SLOT_WORDS) \
                        + chunk * U(4)
                    size = U(16)
                cp_async_16(smem, k_dst, k_words, src, size)
                cp_async_16(smem, v_dst, v_words, src, size)

'''),
    ("    def attend_tile(k_ring, v_ring, base,", "        if first_key + U(KEY_TILE - 1) > warp_position:", r'''    def attend_tile(smem, k_stage, v_stage, first_key, warp_position, lane, gid, tid, q_frag, s, state, real):
        """Add the key tile (keys first_key..+KEY_TILE-1; K at k_stage, V at v_stage of `smem`) into
        this lane's state. Every warp of the block calls it (the wgmma is its warpgroup's)."""
        # S = Q K^T: the warpgroup's 64 rows (its warps' Q fragments) against the tile's keys,
        # one wgmma a 16-dim k step, the result in mma.sync's D layout (ptx/wgmma.py).
        for i in range(S_REGISTERS):
            s[i] = ZERO
        wgmma_fence()
        for kk in range(DIM_STEPS):
            wgmma_f16(s, KEY_TILE, q_frag[4 * kk], q_frag[4 * kk + 1], q_frag[4 * kk + 2], q_frag[4 * kk + 3],
                      smem, k_stage + U((kk // 4) * SLAB_WORDS + 8 * (kk % 4)))
        wgmma_commit_group()
        wgmma_wait_group(0)
        if not real:
            return

'''),
    ("            cp_async_wait_group(0)\n            # Tile kt is visible", "        cp_async_wait_group(0)  # the last (empty) group",
     r'''            cp_async_wait_group(0)
            fence_proxy_async_shared()  # this thread's copies of tile kt, visible to the tensor cores
            # Tile kt is visible to every thread, and every warp is done with tile kt - 1, whose
            # stage is refilled next.
            cuda.syncthreads()
            if kt + U(1) < end_tile:
                load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, (kt + U(1)) % U(STAGES),
                          (kt + U(1)) * U(KEY_TILE), last_key, kv_head)
            cp_async_commit_group()
            # Every tile up to the block's last key: for a warp whose rows all precede it, every
            # weight is exp2(-inf) = 0 and every scale 1 (0 on an empty state), so its state keeps
            # its bits; skipping it per warp, as the mma.sync kernel does, would split a warpgroup.
            attend_tile(smem, k_ring + stage * U(K_TILE_WORDS), v_ring + stage * U(V_TILE_WORDS), kt * U(KEY_TILE),
                        warp_position, lane, gid, tid, q_frag, s, state, real)
            if (kt + U(1)) % U(SEGMENT_TILES) == U(0) and kt + U(1) < end_tile:
                if real:
                    fold_into_shared(running, run_at, state)
                reset(state)
'''),
    ("    def lane_rows(first_row, start):", D + "    def record_at(", r'''    def rings(smem):
        """(K ring, V ring) word offsets in the dynamic shared memory: the K ring at its first
        1024-byte boundary (the swizzle's atom), the V ring after it."""
        k_ring = (U(SWIZZLE_ATOM_BYTES) - shared_byte_address(smem, U(0)) % U(SWIZZLE_ATOM_BYTES)) \
            % U(SWIZZLE_ATOM_BYTES) // U(4)
        return k_ring, k_ring + U(STAGES * K_TILE_WORDS)

    @cuda.jit(device=True, inline="always")
    def lane_rows(first_row, start):
        """(warp, lane, gid, tid, head, warp_row, warp_position, real) of this thread in block (., kv
        head); a padding warp (not real) takes the rows of warp 0."""
        warp, lane = U(cuda.threadIdx.x) // U(32), U(cuda.threadIdx.x) % U(32)
        real = warp < U(REAL_WARPS)
        source = warp if real else U(0)
        head = U(cuda.blockIdx.y) * U(GROUP) + source % U(GROUP)
        warp_row = first_row + U(16) * (source // U(GROUP))  # this warp's 16 rows start here
        return warp, lane, lane // U(4), lane % U(4), head, warp_row, start + warp_row, real

'''),
]
KERNELS = load_source(edited_kernel_source("attention_prefill_kernels_wgmma", HEADER, EDITS, SECTIONS,
                                           kernel="attention_prefill_kernels"), "attention_prefill_kernels_wgmma_kernels")
KEY_TILE, MERGE_PARTS, QUERY_TILE, SEGMENT_KEYS, SPLIT_ROWS, STAGES, build_kernels, state_values = (
    KERNELS.KEY_TILE, KERNELS.MERGE_PARTS, KERNELS.QUERY_TILE, KERNELS.SEGMENT_KEYS, KERNELS.SPLIT_ROWS,
    KERNELS.STAGES, KERNELS.build_kernels, KERNELS.state_values)


def block_warps(num_heads: int, num_kv_heads: int, query_tile: int) -> int:
    """Warps of a block: one 16-row tile of positions for each query head of a KV head, padded to
    whole warpgroups."""
    real = num_heads // num_kv_heads * (query_tile // 16)
    return WARPGROUP // 32 * -(-real // (WARPGROUP // 32))


def shared_bytes(num_heads: int, num_kv_heads: int, head_dim: int, query_tile: int, whole: bool) -> int:
    """Dynamic shared memory of a block: the 1024-byte alignment slack, the rings, and for the
    whole kernel its running state."""
    rings = STAGES * KEY_TILE * (head_dim * 2 + (head_dim // 2 + 4) * 4)
    running = 4 * 32 * block_warps(num_heads, num_kv_heads, query_tile) * state_values(head_dim) if whole else 0
    return SWIZZLE_ATOM_BYTES + rings + running


class WgmmaPrefillAttention(PrefillAttention):
    """The product's PrefillAttention on these kernels: every form with its dynamic shared memory,
    blocks of whole warpgroups, records for their padding warps too."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, *,
                 query_tile: int = QUERY_TILE, segment_keys: int = SEGMENT_KEYS, split_rows: int = SPLIT_ROWS):
        if head_dim % 64 or segment_keys % KEY_TILE or segment_keys < KEY_TILE:
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of 64 (the K ring's 128-byte rows) and "
                             f"segment_keys ({segment_keys}) a positive multiple of {KEY_TILE}")
        super().__init__(num_heads, num_kv_heads, head_dim, max_pages, query_tile, segment_keys, split_rows)
        self.whole, self.split, self.merge = build_kernels(num_heads, num_kv_heads, head_dim, query_tile,
                                                            segment_keys, self.max_segments)
        warps = block_warps(num_heads, num_kv_heads, query_tile)
        self.block = 32 * warps
        self.whole_bytes = shared_bytes(num_heads, num_kv_heads, head_dim, query_tile, whole=True)
        self.split_bytes = shared_bytes(num_heads, num_kv_heads, head_dim, query_tile, whole=False)
        real = num_heads // num_kv_heads * (query_tile // 16)
        self.records = (cuda.device_array(split_records(num_heads, num_kv_heads, head_dim, max_pages, query_tile,
                                                        segment_keys, split_rows) * warps // real, np.float32)
                        if split_rows else None)

    def launch(self, stream, q, k_pages, v_pages, page_table, start, m, out) -> None:
        """As PrefillAttention.launch (whose shape checks this form skips: dev only)."""
        row_blocks = -(-q.shape[0] // self.query_tile)
        words = np.uint32
        k_words, v_words = k_pages.reshape(k_pages.size).view(words), v_pages.reshape(v_pages.size).view(words)
        out_words = out.reshape(out.size).view(words)
        if q.shape[0] <= self.split_rows:
            launch(self.split, (row_blocks, self.num_kv_heads, self.max_segments), self.block, stream,
                   (q, k_words, v_words, page_table, start, m, self.records), self.split_bytes, dependent=False)
            launch(self.merge, (row_blocks, self.num_kv_heads, MERGE_PARTS), self.block, stream,
                   (start, m, self.records, out_words), dependent=False)
        else:
            launch(self.whole, (row_blocks, self.num_kv_heads), self.block, stream,
                   (q, k_words, v_words, page_table, start, m, out_words), self.whole_bytes, dependent=False)


def compile_targets() -> list[CompileTarget]:
    """The three kernels at the 7B shape (sm_90a: wgmma), for tests/test_dev_variants.py."""
    words, floats, ints = types.uint32[::1], types.float32[::1], types.int32[::1]
    q = types.float32[:, :, ::1]
    whole, split, merge = build_kernels(28, 4, 128, QUERY_TILE, SEGMENT_KEYS, segment_count(2048, SEGMENT_KEYS))
    name = "28/4x128, query tile 16"
    wgmma = (f"wgmma.mma_async.sync.aligned.m64n{KEY_TILE}k16.f32.f16.f16", "fence.proxy.async.shared::cta",
             "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    return [CompileTarget(f"prefill_attention wgmma whole[{name}]", whole,
                          types.void(q, words, words, ints, ints, ints, words), wgmma, cc=(9, 0, "a")),
            CompileTarget(f"prefill_attention wgmma split[{name}]", split,
                          types.void(q, words, words, ints, ints, ints, floats), wgmma, cc=(9, 0, "a")),
            CompileTarget(f"prefill_attention wgmma merge[{name}]", merge, types.void(ints, ints, floats, words),
                          ("fma.rn.f32",), cc=(9, 0, "a"))]


# --- check and timings (7B shapes, on the GPU) -----------------------------------------------------

def check(rng):
    """Whole and split forms against float64 (the oracle's bound) at 7B shapes, and the split
    form's bits against the whole form's for the cached /infill's rows (22 over 3984 keys)."""
    from attention_prefill_wgmma import device_chunk, expected_and_bound, random_chunk
    from pynanoqwen.oracles import bound_report, passed

    pages = 8192 // PAGE_SIZE
    results = []
    for start, m, m_cap in ((0, 1, 2048), (0, 512, 2048), (0, 2048, 2048), (6144, 2048, 2048), (3984, 22, 32)):
        chunk = random_chunk(rng, start, m, m_cap, pages)
        expected, bound = expected_and_bound(chunk, start, m)
        outputs = {}
        for form, split_rows in (("whole", 0), ("split", m_cap)):
            attention = WgmmaPrefillAttention(28, 4, 128, pages, split_rows=split_rows)
            out = cuda.to_device(np.full((m_cap, 28 * 128), np.nan, np.float16))
            stream = cuda.stream()
            attention.launch(stream, *device_chunk(chunk, start, m), out)
            stream.synchronize()
            outputs[form] = out.copy_to_host()[:m]
            results.append(bound_report(f"prefill attention wgmma, {form}, start {start}, m {m}",
                                        np.abs(outputs[form].astype(np.float64) - expected), bound))
        differ = int(np.sum(outputs["whole"].view(np.uint16) != outputs["split"].view(np.uint16)))
        results.append(passed(f"whole and split bits, start {start}, m {m}", differ == 0,
                              f"{differ} of {outputs['whole'].size} outputs differ"))
    return results


def timings() -> list[dict]:
    """us a layer of one chunk (10 launches in a graph): the product's kernels and these, in the
    form the engine picks for the chunk (split at M_cap <= 128)."""
    from attention_prefill_wgmma import device_chunk, random_chunk
    from pynanoqwen.gpu_timing import time_graph
    from pynanoqwen.kernels.attention_prefill import attention_flops, make_prefill_attention

    pages = 32768 // PAGE_SIZE
    rows = []
    for start, m, m_cap in ((3984, 22, 32), (0, 512, 512), (0, 2048, 2048), (6144, 2048, 2048), (29952, 2048, 2048)):
        chunk = device_chunk(random_chunk(np.random.default_rng(start + m), start, m, m_cap, pages), start, m)
        out = cuda.to_device(np.zeros((m_cap, 28 * 128), np.float16))
        row = {"chunk": f"rows {start}..{start + m - 1} (M_cap {m_cap})"}
        for name, attention in (("product", make_prefill_attention(28, 4, 128, pages)),
                                ("wgmma", WgmmaPrefillAttention(28, 4, 128, pages))):
            stream = cuda.stream()
            us = 1e6 * time_graph(stream, lambda: [attention.launch(stream, *chunk, out) for _ in range(10)]) / 10
            row[f"{name} us"] = us
            row[f"{name} TFLOP/s"] = attention_flops(start, m, 28, 128) / us / 1e6
        rows.append(row)
    return rows


if __name__ == "__main__":
    from harness import run

    run(check, timings, "prefill attention: the product's kernels against Q K^T on wgmma with segments (us a layer)")
