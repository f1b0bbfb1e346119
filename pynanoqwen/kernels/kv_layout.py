"""The order of the values in a KV-cache page: the one place it is written.

k_pages and v_pages are float16 [num_pages, num_kv_heads, PAGE_SIZE, head_dim] (docs/DECODE.md):
position p lives in page page_table[p // PAGE_SIZE], slot s = p % PAGE_SIZE. Inside the row of a
slot the values are swizzled: the 16-byte chunk c (dims 8c .. 8c + 7) is stored at chunk
c ^ (s % 8), so dim d sits at column d ^ (8 * (s % 8)). The permutation stays inside each aligned
run of 64 dims (128 bytes), so a page row still holds its head's values, and it is its own inverse.

Why. Decode attention copies a (page, KV head) tile, 16 rows of 256 bytes at head_dim 128, into
shared memory with one `cp.async.bulk` and reads it with `ldmatrix`, whose 8 row addresses a
matrix are 8 consecutive rows of one chunk column. Stored row by row they are 256 bytes apart, all
in the same four banks: an 8-way bank conflict in every ldmatrix, ~512 shared-memory cycles a
page. Swizzled, the 8 rows of a column sit in 8 different chunks of their 128 bytes, one wavefront
each, and the copy stays one request a tile (copies that swizzled on the way in cost more at long
contexts: docs/PERFORMANCE.md, "Decode attention, 2026-12-04"). What it gained, a launch and a
decode step: docs/PERFORMANCE.md, "2026-12-06, morning: K/V pages stored swizzled".

Who follows it: the writers (the QKV GEMV's RoPE epilogue, kernels/gemv_int4_kernel.py, and
kernels/rope_kv_write.py) store through `stored_dim`; the readers (kernels/attention_decode.py's
ldmatrix addresses, kernels/attention_prefill_kernels.py's cp.async sources) apply the same XOR to
chunk numbers; host code that reads or fills pages (the engine's probes, the unit checks, tests)
goes through `swizzle_rows`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..errors import ConfigError

CHUNK_HALVES = 8  # float16 values in a 16-byte chunk of a row
SWIZZLE_ROWS = 8  # chunk c of slot s at c ^ (s % SWIZZLE_ROWS): the rows one ldmatrix matrix reads
SWIZZLE_SPAN = CHUNK_HALVES * SWIZZLE_ROWS  # dims one XOR permutes among: head_dim must be a multiple


def check_head_dim(head_dim: int) -> None:
    """The layout needs whole runs of SWIZZLE_SPAN dims (Qwen2.5: 64 or 128)."""
    if head_dim % SWIZZLE_SPAN:
        raise ConfigError(f"the KV-cache pages need head_dim a multiple of {SWIZZLE_SPAN}, got {head_dim}")


@cuda.jit(device=True, inline="always")
def stored_dim(slot, dim):
    """The column of a page row at which dim `dim` of slot `slot` is stored."""
    return dim ^ (CHUNK_HALVES * (slot % SWIZZLE_ROWS))


def swizzle_rows(rows: np.ndarray) -> np.ndarray:
    """A copy of `rows` (last two axes: slot, dim; host memory) in the other order: logical to
    stored, or stored to logical (the permutation is its own inverse)."""
    slots, dims = rows.shape[-2:]
    check_head_dim(dims)
    columns = np.arange(dims)[None, :] ^ (CHUNK_HALVES * (np.arange(slots)[:, None] % SWIZZLE_ROWS))
    return np.take_along_axis(rows, np.broadcast_to(columns, rows.shape), axis=-1)
