"""A KV page tile in shared memory as the copy engine lands it: boxes of 16 key rows, swizzled.

One (page, KV head) tile of a pool (docs/DECODE.md: 16 rows x head_dim FP16, rows 2 x head_dim
bytes apart) is copied as head_dim // box_elems boxes of 16 rows x box_elems dims (64 dims, a
128-byte line, at head_dim 128: two boxes, each 2 KiB), one `cp.async.bulk.tensor` a box through
a tensor map of the pool (ptx/tensor_copy.py). Box b of a stage starts b x BOX_WORDS words in, and
in it row r's 16-byte chunk c (dims 8 c .. 8 c + 7 of the box) sits at the swizzled place of
logical word r x LINE_WORDS + 4 c. The stage must start on a 1024-byte boundary.

Why boxes: an ldmatrix matrix is 8 key rows at the same 8 dims. In a tile copied whole the rows
are 256 bytes apart, all in the same 4 banks, and each matrix takes 8 wavefronts; in the swizzled
boxes the 8 rows' chunks sit in 8 different bank groups and it takes one. decode attention reads
its pages this way (kernels/attention_decode.py).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..errors import ConfigError
from ..ptx.tensor_copy import device_address, encode_tensor_map_2d, swizzle_span, swizzled_word, tensor_copy_2d_to_shared
from . import PAGE_SIZE

BOX_ELEMS = 64  # dims a box spans at most: 128 bytes, the widest swizzled line
U = np.uint32


def box_elems(head_dim: int) -> int:
    """Dims of one box of a K or V tile (the tile is head_dim // box_elems boxes)."""
    if head_dim != 32 and head_dim % BOX_ELEMS:
        raise ConfigError(f"KV tiles are copied in boxes of {BOX_ELEMS} dims: head_dim must be 32 or a multiple "
                          f"of {BOX_ELEMS}, got {head_dim}")
    return min(head_dim, BOX_ELEMS)


def kv_tensor_maps(k_pages, v_pages) -> np.ndarray:
    """The K and V pools' tensor maps (uint64 [2, 16]; 0 is K, 1 is V), boxes as above."""
    box = box_elems(k_pages.shape[k_pages.ndim - 1])
    return np.stack([encode_tensor_map_2d(pages, box, PAGE_SIZE) for pages in (k_pages, v_pages)])


class KvTensorMaps:
    """The device copies of pools' tensor maps, one uint64 [2, 16] array per (K pool, V pool) pair,
    made (256 bytes allocated) when first asked for: the engine runs every layer's launches once at
    load, so decoding allocates nothing (engine/memory.py counts them)."""

    def __init__(self):
        self.maps = {}  # (K pool address, V pool address) -> their maps on the device

    def of(self, k_pages, v_pages):
        key = (device_address(k_pages), device_address(v_pages))
        if key not in self.maps:
            self.maps[key] = cuda.to_device(kv_tensor_maps(k_pages, v_pages))
        return self.maps[key]


class TileLayout:
    """The layout of one head_dim's tiles: sizes in 32-bit words, and its two device functions.

    copy(words, at, kv_maps, tensor, row, bars, stage): one thread asks for the tile whose first
    pool row is `row` (K: tensor 0, V: 1) to land at words[at:]; the boxes complete their bytes on
    bars[stage]. word(row, chunk): where row `row`'s 16-byte chunk `chunk` of dims landed."""

    def __init__(self, head_dim: int):
        box = box_elems(head_dim)
        self.boxes = head_dim // box
        self.line_words = box // 2  # a key row's share of one box: one swizzled line
        self.box_words = PAGE_SIZE * self.line_words
        self.line_chunks = self.line_words // 4
        boxes, line_words, box_words, line_chunks = self.boxes, self.line_words, self.box_words, self.line_chunks
        mask = U(swizzle_span(box) // 16 - 1)

        @cuda.jit(device=True, inline="always")
        def copy(words, at, kv_maps, tensor, row, bars, stage):
            for b in range(boxes):
                start = at + b * box_words
                tensor_copy_2d_to_shared(words[start:start + box_words], kv_maps, tensor, b * box, row, bars, stage)

        @cuda.jit(device=True, inline="always")
        def word(row, chunk):
            row, chunk = U(row), U(chunk)  # 32-bit index math (docs/HARDWARE.md)
            return U((chunk // line_chunks) * box_words + swizzled_word(U(row * line_words + 4 * (chunk % line_chunks)),
                                                                        mask))

        self.copy, self.word = copy, word
