"""Decode attention over K/V pages stored pre-swizzled, against the product's kernel
(kernels/attention_decode.py), which reads pages stored row by row.

Why. A consumer warp's 16 `ldmatrix.x4` a page read rows 256 bytes apart, all in the same four
banks: an 8-way conflict in every matrix, ~512 shared-memory cycles a page (the product's
docstring). Two forms without the conflict were measured: the copy engine writing each tile as
two boxes with its 128-byte swizzle (a6f059f, 614d242) was faster alone at every context (0.4 us
a launch at 512 tokens, 1.2-2.4 at 4096-16384, 1.4 at 32000) but the step lost 40-50 us at
16384-32000, not explained (the open question: the two box requests a tile, rows 256 bytes
apart, against one 4 KiB copy, meeting the next kernel's early weight loads); per-thread cp.async
copies into a swizzled ring (dev/attention_swizzled_ring.py) lost at 32000 (docs/PERFORMANCE.md,
"Decode attention, 2026-12-04").

Here the swizzle is in the pages themselves: in the tile of (page, KV head), 16-byte chunk c of
key row r is stored at chunk c ^ (r % 8). The producer's copy is the product's, one contiguous
`cp.async.bulk` of each 4 KiB tile into the ring, and the consumers' ldmatrix addresses apply the
same XOR: the 8 rows of a matrix then sit in 8 different chunks of their 128 bytes, one
wavefront each. The zeroing of V rows past the context clears whole rows, which the swizzle only
permutes within. So this kernel keeps the product's request stream and loses the conflicts: if
it keeps the boxes' kernel-level gain, what the step lost with boxes came from their requests.

Not the product: the pages' writers (the QKV GEMV's RoPE epilogue and prefill's rope_kv_write)
and their other reader (prefill attention, which gathers 16-byte chunks and would un-XOR their
source addresses), the self-check's and the tests' page readers would all have to agree on the
layout first, and only a GPU run says whether it pays. `swizzle_pages` lays a pool out this way
(on the device, for the harness's pools); `SwizzledPages` wraps the kernel so that it takes the
product's row-by-row pools, swizzles each pool once and reads the copy, so the harness's float64
checks and timings run unchanged. tests/sim/test_attention_sim.py checks it in the simulator,
tests/test_dev_variants.py compiles it; on the GPU:

    python dev/attention_swizzled_pages.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     time_decode_attention, variant_compile_target)
from pynanoqwen.kernels.attention_decode import make_decode_attention  # noqa: E402

CHUNK_HALVES = 8  # a 16-byte chunk of a key row: 8 float16
SWIZZLE_ROWS = 8  # chunk c of row r at c ^ (r % 8): the 8 rows an ldmatrix matrix reads

EDITS = [
    # K: lane 8m + r reads chunk 4 kk2 + m of key row 8 j + r.
    ("b0, b1, b2, b3 = ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
     "                                                     + 16 * kk2 + 4 * (lane // 8))",
     "b0, b1, b2, b3 = ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
     "                                                     + 4 * ((4 * kk2 + lane // 8) ^ (lane % 8)))"),
    # V, transposed: lane 8m + r reads chunk 2 jp + m // 2 of key row 8 (m % 2) + r.
    ("b0, b1, b2, b3 = ldmatrix_x4_trans(words, V_RING + base + (8 * ((lane // 8) % 2) + lane % 8)\n"
     "                                                       * SMEM_ROW_WORDS + 8 * jp + 4 * (lane // 16))",
     "b0, b1, b2, b3 = ldmatrix_x4_trans(words, V_RING + base + (8 * ((lane // 8) % 2) + lane % 8)\n"
     "                                                       * SMEM_ROW_WORDS\n"
     "                                                       + 4 * ((2 * jp + lane // 16) ^ (lane % 8)))"),
]


def load_variant():
    return load_source(edited_kernel_source("attention_swizzled_pages", "", EDITS), "attention_swizzled_pages_kernel")


def swizzle_pages_host(pages: np.ndarray) -> np.ndarray:
    """A [pages, kv_heads, 16, head_dim] float16 pool with chunk c of each key row r stored at
    c ^ (r % 8) (numpy; head_dim a multiple of 64)."""
    *outer, rows, dim = pages.shape
    chunks = pages.reshape(*outer, rows, dim // CHUNK_HALVES, CHUNK_HALVES)
    out = np.empty_like(chunks)
    for r in range(rows):
        for c in range(dim // CHUNK_HALVES):
            out[..., r, c ^ (r % SWIZZLE_ROWS), :] = chunks[..., r, c, :]
    return out.reshape(pages.shape)


@cuda.jit
def _swizzle_kernel(src, dst, chunks_per_row, rows_per_tile):
    """One 16-byte chunk (4 words) a thread: src row-major uint32 [rows, chunks_per_row * 4]."""
    i = cuda.grid(1)
    if i < src.shape[0] * chunks_per_row:
        row, chunk = i // chunks_per_row, i % chunks_per_row
        to = chunk ^ (row % rows_per_tile % SWIZZLE_ROWS)
        for w in range(4):
            dst[row, 4 * to + w] = src[row, 4 * chunk + w]


def swizzle_pages(pages):
    """swizzle_pages_host on the device: a new array (the simulator runs it too)."""
    num_pages, kv_heads, rows_per_tile, dim = pages.shape
    rows = num_pages * kv_heads * rows_per_tile
    out = cuda.device_array(pages.shape, np.float16)
    chunks = dim // CHUNK_HALVES
    threads = 128
    words = [a.reshape(rows, dim).view(np.uint32) for a in (pages, out)]
    _swizzle_kernel[-(-rows * chunks // threads), threads](*words, chunks, rows_per_tile)
    return out


class SwizzledPages:
    """The variant's kernel taking the product's pools: each pool (each device array object, kept
    alive beside its copy so that its id stays its own) is swizzled once, outside any graph capture
    (the harness's first launch is eager), and the copy is read."""

    def __init__(self, attention):
        self.attention = attention
        self.copies: dict[int, object] = {}

    def _copy(self, pages):
        if id(pages) not in self.copies:
            self.copies[id(pages)] = (pages, swizzle_pages(pages))
            cuda.synchronize()
        return self.copies[id(pages)][1]

    def launch(self, stream, q, k_pages, v_pages, page_table, pos, out):
        self.attention.launch(stream, q, self._copy(k_pages), self._copy(v_pages), page_table, pos, out)


def make_swizzled(*args, **kwargs) -> SwizzledPages:
    """make_decode_attention's arguments: the variant, taking row-by-row pools."""
    return SwizzledPages(load_variant().make_decode_attention(*args, **kwargs))


def builders() -> dict:
    """name -> build(max_pages): the product's kernel and the variant."""
    heads, kv_heads, head_dim = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim
    return {"product": lambda max_pages: make_decode_attention(heads, kv_heads, head_dim, max_pages),
            "swizzled pages": lambda max_pages: make_swizzled(heads, kv_heads, head_dim, max_pages)}


def check(rng):
    """Contexts of one split with pages up to all of them, partial last pages, and the longest."""
    return check_decode_attention(builders(), (1, 16, 17, 128, 129, 545, 4097, 32768), rng, launches=2)


def timings() -> list[dict]:
    """The product's contexts and two partial last pages (545, 4097: the step's usual case)."""
    return time_decode_attention(builders(), (16, 512, 545, 4096, 4097, 16384, 32000))


def compile_targets():
    """The variant at 7B shapes, for tests/test_dev_variants.py's compile check."""
    module = load_variant()
    splits = module.default_num_splits(SEVEN_B.num_kv_heads, 132)
    return [variant_compile_target(module, f"decode_attention swizzled pages[{splits} splits]", None, splits)]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: K/V pages stored swizzled (chunk c of row r at c ^ r % 8), "
                        "against row by row")
