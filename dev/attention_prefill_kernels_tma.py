"""Prefill attention with its K/V pages brought by the copy engine (TMA), the product's kernels but
for their copy ring: is the copies' bookkeeping what its consumer warps wait on?

The product (kernels/attention_prefill_kernels.py) copies each 64-key tile with 16 `cp.async` a
thread, each with a page-table lookup and its own address arithmetic, then waits for its copies and
meets every other warp at a block barrier before the tile's wgmmas: both warpgroups run the tile in
lockstep, so the tensor cores idle while both do their softmax. Here:
- thread 0 fills each stage with `cp.async.bulk.tensor` boxes of one page, one 64-dim slab and one
  tensor (16 rows x 128 bytes, no swizzle: the page already stores its rows swizzled,
  kernels/kv_layout.py, so the box lands as the K and V tiles must be), 16 boxes a 64-key tile at
  head_dim 128, their bytes completing on the stage's `full` mbarrier (ptx/tensor_copy.py), once
  every thread has released the stage's previous tile on its `empty` mbarrier;
- STAGES stages (4: 128 KiB of rings at head_dim 128, and the whole kernel's 68 KiB of running
  state), thread 0 filling AHEAD = STAGES - 1 tiles ahead, so a warpgroup may run up to a tile
  ahead of the other instead of meeting it at a barrier every tile;
- pages wholly past the block's last key are not copied, and in the block's last tile every thread
  writes zeros over the V rows past its last key (a page's later slots may hold anything, NaN
  included, and P's zeros times NaN would reach O), then one block barrier: the only one in the
  walk. K's rows past the last key need nothing: every score they give is masked to -inf.
Everything else (the wgmmas, softmax, segments, folds, split form and merge) is the product's, as
edits of its source (harness.edited_kernel_source), so the two give the same bits.

Counted, not measured: the product's tile loop is 1082 PTX instructions a warp (dev/ptx_loop_mix.py),
of which the copies' ~16 cp.async, their lookups and addresses are ~150-200; here a warp's share of a
tile is an mbarrier wait and an arrive, and warp 0's thread 0 adds ~60 for the 16 boxes.
Measured (H100, docs/PERFORMANCE.md, 2026-12-07 late night): bit for bit the product's, and slower:
3917.2 (3 stages) and 3789.3 us (4) against 3111.9 for a 2048-row chunk at 29952, 22.0 against 19.9
at 512 rows, so the copies' bookkeeping is not what the product's warps wait on.

    python dev/attention_prefill_kernels_tma.py     # 7B: float64 checks, bits against the product, us a layer
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import edited_kernel_source  # noqa: E402
from pynanoqwen.kernels import PAGE_SIZE  # noqa: E402
from pynanoqwen.kernels.attention_prefill import MERGE_PARTS, QUERY_TILE, SEGMENT_KEYS, SPLIT_ROWS, KEY_TILE, \
    block_warps, segment_count, split_records, state_values  # noqa: E402
from pynanoqwen.launch import launch  # noqa: E402
from pynanoqwen.ptx.tensor_copy import tensor_map  # noqa: E402
from pynanoqwen.ptx.wgmma import SWIZZLE_ATOM_BYTES  # noqa: E402

STAGES = 4  # the default; main() times others too
HEADER = '''
from pynanoqwen.ptx.mbarrier import fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, \\
    mbarrier_wait
from pynanoqwen.ptx.tensor_copy import acquire_tensor_map, tensor_copy_2d
'''

FILL = '''    AHEAD = STAGES - 1  # tiles thread 0 has asked for beyond the one being computed
    PAGES_PER_TILE = KEY_TILE // PAGE_SIZE
    SLABS = head_dim // 64
    PAGE_BYTES = 2 * PAGE_SIZE * head_dim * 2  # a page's K and V rows of one KV head

    @cuda.jit(device=True, inline="always")
    def start_ring(k_map, v_map, page_table, smem, k_ring, v_ring, bars, first_tile, end_tile, last_key, kv_head):
        """Thread 0: the ring's barriers (full s at bars[s], empty s at bars[STAGES + s]), then the
        first AHEAD tiles asked for; every thread meets at one barrier before any waits."""
        if cuda.threadIdx.x == 0:
            for stage in range(STAGES):
                mbarrier_init(bars, stage, 1)  # thread 0's arrive.expect_tx; the boxes add their bytes
                mbarrier_init(bars, STAGES + stage, THREADS)  # every thread, done with the stage's tile
            fence_barrier_init()
            acquire_tensor_map(k_map)
            acquire_tensor_map(v_map)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            for j in range(AHEAD):
                if first_tile + U(j) < end_tile:
                    fill_tile(k_map, v_map, page_table, smem, k_ring, v_ring, bars, U(j), first_tile + U(j),
                              last_key, kv_head)

    @cuda.jit(device=True, inline="always")
    def fill_tile(k_map, v_map, page_table, smem, k_ring, v_ring, bars, j, kt, last_key, kv_head):
        """Thread 0: key tile kt, the walk's tile j, into stage j % STAGES once every thread has
        released that stage's previous tile; pages wholly past last_key are not copied."""
        stage = j % U(STAGES)
        # Fill j // STAGES of this stage needs the release of the fill before; in the first round
        # parity 1 names the phase before phase 0, which counts as complete.
        mbarrier_wait(bars, U(STAGES) + stage, ((j // U(STAGES)) & U(1)) ^ U(1))
        first_key = kt * U(KEY_TILE)
        pages = min(U(PAGES_PER_TILE), (last_key - first_key) // U(PAGE_SIZE) + U(1))
        mbarrier_arrive_expect_tx(bars, stage, pages * U(PAGE_BYTES))
        for p in range(PAGES_PER_TILE):
            if U(p) < pages:
                row = (U(page_table[first_key // U(PAGE_SIZE) + U(p)]) * U(num_kv_heads) + kv_head) * U(PAGE_SIZE)
                for slab in range(SLABS):
                    word = stage * U(TILE_WORDS) + U(slab * SLAB_WORDS + p * PAGE_SIZE * 32)
                    tensor_copy_2d(smem, k_ring + word, k_map, U(64 * slab), row, bars, stage)
                    tensor_copy_2d(smem, v_ring + word, v_map, U(64 * slab), row, bars, stage)

    @cuda.jit(device=True, inline="always")
    def zero_tail(smem, v_stage, first_key, last_key):
        """Every thread: zeros over the V rows of the tile at v_stage past last_key."""
        first_row = last_key + U(1) - first_key
        words = (U(KEY_TILE) - first_row) * U(ROW_WORDS)
        for w in range(U(cuda.threadIdx.x), words, U(THREADS)):
            row, within = first_row + w // U(ROW_WORDS), w % U(ROW_WORDS)
            smem[v_stage + (within // U(32)) * U(SLAB_WORDS) + row * U(32) + within % U(32)] = U(0)

'''

WALK = '''    @cuda.jit(device=True, inline="always")
    def walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, gid, tid, q_frag, s, p_frag, state, running, run_at, real, bars):
        """Tiles first_tile..end_tile - 1 into `state` through the TMA ring (start_ring has asked
        for the first AHEAD); k_words and v_words are the pages' tensor maps. Folds as the product's."""
        for kt in range(first_tile, end_tile):
            j = kt - first_tile
            stage = j % U(STAGES)
            if cuda.threadIdx.x == 0 and kt + U(AHEAD) < end_tile:
                fill_tile(k_words, v_words, page_table, smem, k_ring, v_ring, bars, j + U(AHEAD), kt + U(AHEAD),
                          last_key, kv_head)
            mbarrier_wait(bars, stage, (j // U(STAGES)) & U(1))
            if kt * U(KEY_TILE) + U(KEY_TILE - 1) > last_key:  # the block's last tile (uniform in the block)
                zero_tail(smem, v_ring + stage * U(TILE_WORDS), kt * U(KEY_TILE), last_key)
                fence_proxy_async_shared()
                cuda.syncthreads()
            attend_tile(smem, k_ring + stage * U(TILE_WORDS), v_ring + stage * U(TILE_WORDS), kt * U(KEY_TILE),
                        warp_position, gid, tid, q_frag, s, p_frag, state)
            mbarrier_arrive(bars, U(STAGES) + stage)
            if (kt + U(1)) % U(SEGMENT_TILES) == U(0) and kt + U(1) < end_tile:
                if real:
                    fold_into_shared(running, run_at, state)
                reset(state)

'''


def kernels_source(stages: int = STAGES) -> str:
    who = "dev/attention_prefill_kernels_tma.py"
    return edited_kernel_source(
        who, HEADER,
        [("STAGES = 2  # (K, V) tiles in shared memory: 64 KiB at head_dim 128",
          f"STAGES = {stages}  # (K, V) tiles in shared memory\nRING_BARRIERS = {2 * stages}  # full and empty of each"),
         ("        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings, then WARPS x STATE x 32 floats\n",
          "        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings, then WARPS x STATE x 32 floats\n"
          "        bars = cuda.shared.array(RING_BARRIERS, types.uint64)\n"),
         ("        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings\n",
          "        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings\n"
          "        bars = cuda.shared.array(RING_BARRIERS, types.uint64)\n"),
         ("        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), U(0), last_key, kv_head)\n"
          "        cp_async_commit_group()\n",
          "        start_ring(k_words, v_words, page_table, smem, k_ring, v_ring, bars, U(0), key_tiles, last_key,"
          " kv_head)\n"),
         ("        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile % U(STAGES), first_tile * U(KEY_TILE),\n"
          "                  last_key, kv_head)\n"
          "        cp_async_commit_group()\n",
          "        start_ring(k_words, v_words, page_table, smem, k_ring, v_ring, bars, first_tile, end_tile, last_key,"
          " kv_head)\n"),
         ("warp_position, gid, tid, q_frag, s, p_frag, state, running, run_at, real)\n",
          "warp_position, gid, tid, q_frag, s, p_frag, state, running, run_at, real, bars)\n"),
         ("warp_position, gid, tid, q_frag, s, p_frag, state, unused, U(0), real)",
          "warp_position, gid, tid, q_frag, s, p_frag, state, unused, U(0), real, bars)")],
        [("    @cuda.jit(device=True, inline=\"always\")\n    def load_tile(",
          "    @cuda.jit(device=True, inline=\"always\")\n    def load_q(", FILL),
         ("    @cuda.jit(device=True, inline=\"always\")\n    def walk_tiles(",
          "    @cuda.jit(device=True, inline=\"always\")\n    def store_rows(", WALK)],
        kernel="attention_prefill_kernels")


def load_kernels_module(stages: int = STAGES):
    """The edited kernels module with `stages` stages, imported from its source."""
    import importlib.util
    import os
    import tempfile

    name = f"attention_prefill_kernels_tma_{stages}_stages"
    path = Path(tempfile.gettempdir()) / f"{name}.py"
    # Written aside and renamed into place: pytest's workers load the module at once, and one
    # truncating the file while another imports it left that one without build_kernels.
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text(kernels_source(stages))
    os.replace(partial, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TmaPrefillAttention:
    """The variant's kernels for one attention shape, launched as PrefillAttention launches the
    product's (its `launch` takes the same arguments); the pages' tensor maps are made at the
    first launch with each pool and kept (a map holds the pool's address)."""

    def __init__(self, num_heads, num_kv_heads, head_dim, max_pages, query_tile=QUERY_TILE,
                 segment_keys=SEGMENT_KEYS, split_rows=SPLIT_ROWS, stages=STAGES):
        module = load_kernels_module(stages)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.query_tile, self.split_rows = query_tile, split_rows
        self.max_segments = segment_count(max_pages, segment_keys)
        self.whole, self.split, self.merge = module.build_kernels(num_heads, num_kv_heads, head_dim, query_tile,
                                                                  segment_keys, self.max_segments)
        warps = block_warps(num_heads, num_kv_heads, query_tile)
        self.block = 32 * warps
        rings = SWIZZLE_ATOM_BYTES + stages * 2 * KEY_TILE * head_dim * 2
        self.split_bytes = rings
        self.whole_bytes = rings + 4 * 32 * warps * state_values(head_dim)
        self.records = (cuda.device_array(split_records(num_heads, num_kv_heads, head_dim, max_pages, query_tile,
                                                        segment_keys, split_rows), np.float32)
                        if split_rows else None)
        self.maps: dict = {}

    def page_map(self, pages):
        """The tensor map of a K or V pool: boxes of one page's 16 rows of one 64-dim slab."""
        from pynanoqwen.ptx import SIMULATOR

        key = id(pages) if SIMULATOR else pages.device_ctypes_pointer.value
        if key not in self.maps:
            rows = pages.shape[0] * pages.shape[1] * PAGE_SIZE
            self.maps[key] = (pages, tensor_map(pages.reshape(rows, self.head_dim), 64, PAGE_SIZE, False))
        return self.maps[key][1]

    def launch(self, stream, q, k_pages, v_pages, page_table, start, m, out) -> None:
        m_cap = q.shape[0]
        row_blocks = -(-m_cap // self.query_tile)
        k_map, v_map = self.page_map(k_pages), self.page_map(v_pages)
        out_words = out.reshape(out.size).view(np.uint32)
        if m_cap <= self.split_rows:
            launch(self.split, (row_blocks, self.num_kv_heads, self.max_segments), self.block, stream,
                   (q, k_map, v_map, page_table, start, m, self.records), self.split_bytes, dependent=False)
            launch(self.merge, (row_blocks, self.num_kv_heads, MERGE_PARTS), self.block, stream,
                   (start, m, self.records, out_words), dependent=False)
        else:
            launch(self.whole, (row_blocks, self.num_kv_heads), self.block, stream,
                   (q, k_map, v_map, page_table, start, m, out_words), self.whole_bytes, dependent=False)


def compile_targets():
    """The whole and split kernels at 7B shapes (28 over 4 heads, head_dim 128, 32768 positions),
    for tests/test_dev_variants.py's compile check."""
    from numba import types

    from pynanoqwen.kernels import CompileTarget

    module = load_kernels_module()
    whole, split, _ = module.build_kernels(28, 4, 128, QUERY_TILE, SEGMENT_KEYS, segment_count(2048, SEGMENT_KEYS))
    maps, words, floats, ints = types.uint64[::1], types.uint32[::1], types.float32[::1], types.int32[::1]
    q = types.float32[:, :, ::1]
    contains = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", "mbarrier.try_wait.parity.shared::cta.b64")
    return [CompileTarget("prefill_attention TMA ring[28/4x128]", whole,
                          types.void(q, maps, maps, ints, ints, ints, words), contains, cc=(9, 0, "a")),
            CompileTarget("prefill_attention_split TMA ring[28/4x128]", split,
                          types.void(q, maps, maps, ints, ints, ints, floats), contains, cc=(9, 0, "a"))]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_attention_prefill_gpu as product_tests
    from attention_prefill_oracle import reference_and_bound
    from pynanoqwen.gpu_timing import time_graph
    from pynanoqwen.kernels.attention_prefill import attention_flops, make_prefill_attention

    heads, kv_heads, head_dim, max_pages = (product_tests.NUM_HEADS, product_tests.NUM_KV_HEADS,
                                            product_tests.HEAD_DIM, product_tests.MAX_PAGES)
    product_tests.POOL_PAGES = 2100  # room for 32k positions
    forms = {"product": make_prefill_attention(heads, kv_heads, head_dim, max_pages)}
    for stages in (3, 4):
        forms[f"TMA ring, {stages} stages"] = TmaPrefillAttention(heads, kv_heads, head_dim, max_pages, stages=stages)
    stream = cuda.stream()
    print("| chunk | worst check / bound | elements differing from the product | "
          + " | ".join(f"{name} us (TFLOP/s)" for name in forms) + " |", flush=True)
    for start, m, rows in ((3984, 22, 32), (0, 512, 2048), (0, 2048, 2048), (6144, 2048, 2048),
                           (29952, 2048, 2048)):
        case = product_tests.Case(np.random.default_rng(start + m), start, m)
        ratios, differ, product_bits = [], [], None
        if start + m <= 8192:  # the host reference takes minutes at 32k
            expected, tolerance = reference_and_bound(case.q, case.k_pages, case.v_pages, case.page_table, start, m)
        for attention in forms.values():
            case.launch_rows(attention, stream, rows)
            stream.synchronize()
            got = case.out.copy_to_host()[:m]
            product_bits = got.view(np.uint16) if product_bits is None else product_bits
            differ.append(int(np.sum(got.view(np.uint16) != product_bits)))
            if start + m <= 8192:
                error = np.abs(got.astype(np.float64) - expected)
                ratios.append(float(np.max(error / tolerance)) if np.all(error <= tolerance) else float("inf"))
        launches = 5 if start < 8192 else 2
        times = {name: [] for name in forms}
        for _ in range(2):
            for name, attention in forms.items():
                times[name].append(time_graph(stream, lambda a=attention: [case.launch_rows(a, stream, rows)
                                                                          for _ in range(launches)]) / launches)
        flops = attention_flops(start, m, heads, head_dim)
        cells = [f"{min(t) * 1e6:.1f} ({flops / min(t) / 1e12:.0f})" for t in times.values()]
        worst = f"{max(ratios):.3f}" if ratios else "-"
        print(f"| {m} rows at {start} in {rows} | {worst} | {'/'.join(map(str, differ[1:]))} | "
              + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
