"""Decode attention whose ring holds each page swizzled, so that ldmatrix reads it without bank
conflicts, against the product's kernel (kernels/attention_decode.py).

The product copies a (page, KV head) tile of K or V, 16 rows of head_dim FP16, with one
`cp.async.bulk` into a ring stage laid out as in global memory. The 8 rows of each 8 x 8 matrix
that `ldmatrix` reads are then 256 bytes apart, all in the same four banks: every ldmatrix.x4
takes 8 times its conflict-free time, ~512 shared-memory cycles a page (the product's docstring).
With four consumer warps contending for the one shared-memory pipe, that is ~1 us a page, close
to the ~1.3 us a page a consumer measured (docs/PERFORMANCE.md, the timeline at 4096 tokens).

Here the producer warp's 32 lanes copy the tiles 16 bytes at a time (`cp.async.cg`, 8 chunks of
K and 8 of V a lane at 7B) and put chunk c of row r at chunk c ^ (r % 8) of that row; each lane
then makes one `cp.async.mbarrier.arrive.noinc` on the stage's `full` barrier (so it expects 32
arrivals), which fires once that lane's copies have landed. The consumers' ldmatrix addresses
apply the same XOR: the 8 rows of a matrix now fall in 8 different bank groups. Global memory,
and so every writer of the KV cache, keeps the product's layout.

The variant is the product's source with the edits below applied at import (each anchor must occur
once, so a change of the product's kernel stops this script rather than time something else).
tests/sim/test_attention_sim.py runs it in the simulator; on the GPU:

    python dev/attention_swizzled_ring.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     time_decode_attention, variant_compile_target)
from pynanoqwen.kernels.attention_decode import make_decode_attention  # noqa: E402

HEADER = '''
from numba.cuda.extending import intrinsic as _intrinsic
from pynanoqwen.ptx import simulator_twin as _simulator_twin
from pynanoqwen.ptx.mbarrier import barrier_address as _barrier_address, inline_ptx as _inline_ptx, \\
    _barrier_operands, _update as _mbarrier_update
from pynanoqwen.ptx.mma import _copy_queue, cp_async_16


def _cp_async_arrive_noinc_simulated(bars, index):
    queue = _copy_queue()  # this thread's copies land first, then its arrival counts
    for group in queue.committed + [queue.open]:
        for dst, dst_index, data in group:
            dst[dst_index:dst_index + 4] = data
    queue.committed, queue.open = [], []
    _mbarrier_update(bars, index, 1, 0)


@_simulator_twin(_cp_async_arrive_noinc_simulated)
@_intrinsic
def cp_async_arrive_noinc(typingctx, bars, index):
    """One arrival on bars[index] once this thread's earlier cp.async copies have landed:
    `cp.async.mbarrier.arrive.noinc.shared::cta.b64 [addr];` (noinc: the barrier's expected count
    includes it)."""
    if not _barrier_operands(bars, index):
        return None

    def codegen(context, builder, sig, args):
        address = _barrier_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        _inline_ptx(builder, "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r,~{memory}", [address])
        return context.get_dummy_value()

    return types.void(bars, index), codegen


def _words(pages):
    """A KV pool as the flat uint32 array the variant's producer reads 16 bytes at a time."""
    return pages.reshape(pages.size).view(np.uint32)
'''

FILL_START = '    @cuda.jit(device=True, inline="always")\n    def fill_stage('
FILL_END = "    @cuda.jit\n    def decode_attention("
FILL_STAGE = '''    CHUNKS = head_dim // 8  # 16-byte chunks of a K or V row
    SWIZZLE = min(8, CHUNKS)  # chunk c of row r sits at chunk c ^ (r % SWIZZLE) of the ring's row

    @cuda.jit(device=True, inline="always")
    def fill_stage(words, full, empty, pages_ahead, k_pages, v_pages, page_table, kv_head, first_page, num_pages, i,
                   lane):
        """The producer warp's page i of its split: its K and V tiles into stage i % stages, swizzled."""
        if i % 32 == 0:
            # The next 32 page-table entries, one load per lane, through shared memory: a load per
            # page would put an L2 round trip between every two pages' copies.
            entry = page_table[first_page + i + lane] if i + lane < num_pages else 0
            syncwarp()  # every lane is done with the previous 32
            pages_ahead[lane] = entry
            syncwarp()
        stage = i % stages
        if lane == 0:
            # Fill i // stages of this stage needs its consumer's release of the previous fill; on
            # the first round parity 1 names the phase before phase 0, complete.
            mbarrier_wait(empty, stage, ((i // stages) & 1) ^ 1)
        syncwarp()  # every lane writes the stage
        source = (pages_ahead[i % 32] * num_kv_heads + kv_head) * PAGE_WORDS
        at = stage * PAGE_WORDS
        for chunk in range(lane, PAGE_SIZE * CHUNKS, 32):
            row, column = chunk // CHUNKS, chunk % CHUNKS
            place = at + row * ROW_WORDS + 4 * (column ^ (row % SWIZZLE))
            cp_async_16(words, K_RING + place, k_pages, source + 4 * chunk, 16)
            cp_async_16(words, V_RING + place, v_pages, source + 4 * chunk, 16)
        cp_async_arrive_noinc(full, stage)

'''
EDITS = [
    ("mbarrier_init(full, stage, 1)  # the producer's arrive.expect_tx; the copies add bytes",
     "mbarrier_init(full, stage, 32)  # each producer lane, once its copies have landed"),
    ("ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
     "                                                     + 16 * kk2 + 4 * (lane // 8))",
     "ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
     "                                                     + 4 * ((4 * kk2 + lane // 8) ^ (lane % SWIZZLE)))"),
    ("ldmatrix_x4_trans(words, V_RING + base + (8 * ((lane // 8) % 2) + lane % 8)\n"
     "                                                       * SMEM_ROW_WORDS + 8 * jp + 4 * (lane // 16))",
     "ldmatrix_x4_trans(words, V_RING + base + (8 * ((lane // 8) % 2) + lane % 8)\n"
     "                                                       * SMEM_ROW_WORDS + 4 * ((2 * jp + lane // 16) ^ (lane % SWIZZLE)))"),
    ("               (q, k_pages, v_pages, page_table, pos, out, self.part_max",
     "               (q, _words(k_pages), _words(v_pages), page_table, pos, out, self.part_max"),
]


def variant_source() -> str:
    return edited_kernel_source("attention_swizzled_ring", HEADER, EDITS, [(FILL_START, FILL_END, FILL_STAGE)])


def load_variant():
    return load_source(variant_source(), "attention_swizzled_ring_kernel")


def builders(*variant_settings: dict) -> dict:
    """name -> build(max_pages): the product's kernel, then the variant at each of the settings."""
    heads, kv_heads, head_dim = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim
    variant = load_variant()
    chosen = {"product": lambda max_pages: make_decode_attention(heads, kv_heads, head_dim, max_pages)}
    for settings in variant_settings:
        chosen[f"swizzled {settings or ''}".strip()] = (
            lambda max_pages, settings=settings: variant.make_decode_attention(heads, kv_heads, head_dim, max_pages,
                                                                               **settings))
    return chosen


def check(rng):
    return check_decode_attention(builders({}), (1, 16, 17, 512, 4096, 32768), rng)


def timings() -> list[dict]:
    """The product, and the variant with the product's ring and with 16 stages (us a launch)."""
    return time_decode_attention(builders({}, {"stages": 16}), (16, 512, 4096, 32000))


def compile_targets():
    """The variant at 7B shapes, for tests/test_dev_variants.py's compile check: its pools are flat
    uint32 arrays, and it makes no bulk copies."""
    from numba import types

    module = load_variant()
    words, flat = types.uint32[::1], types.float32[::1]
    signature = types.void(types.float32[:, ::1], words, words, types.int32[::1], types.int32[::1],
                           types.float16[::1], flat, flat, flat, types.int32[::1])
    return [variant_compile_target(module, "decode_attention swizzled ring[28/4x128]", signature,
                                   module.default_num_splits(SEVEN_B.num_kv_heads, 132),
                                   drop=("cp.async.bulk", "mbarrier.arrive.expect_tx"),
                                   add=("cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc.shared::cta.b64"))]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: swizzled ring (cp.async) against bulk-copied pages (us a launch)")
