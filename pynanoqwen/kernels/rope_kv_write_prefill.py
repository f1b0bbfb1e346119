"""RoPE on a prefill chunk's q and k, and the write of its k and v into the paged KV cache.

The batched form of kernels/rope_kv_write.py: `qkv` is float32 [R, q_size + 2 kv_size], the QKV
GEMM's output (bias included) for the R rows of the chunk's bucket, each row laid out as q heads,
then k heads, then v heads. Row i < m is the token at position p = start + i:

    q[i, h] = rope(qkv[i] q head h, p)                     float32 [R, num_heads, head_dim]
    k_pages[page, g, slot] = float16(rope(qkv[i] k head g, p))   page = page_table[p // 16], slot = p % 16
    v_pages[page, g, slot] = float16(qkv[i] v head g)

with the same rotate_half convention and the same host-made float64 angle tables (rope_cos_sin)
as the decode kernel, so a position's K/V come out as the decode step would write them from the
same qkv. `start` and `m` are device arrays (int32 [1]): one captured graph serves every chunk of
its bucket. Rows m .. R - 1 are padding and write nothing: their positions may lie in pages that
are not allocated (page_table holds stale entries there), and their q is never read.

Launch: grid (num_heads + 2 num_kv_heads, R), head_dim / 2 threads. Block (b, i) handles head b
(q heads, then k heads, then v heads) of row i; thread t the pair (t, t + head_dim / 2).
Traffic at 7B per row: 18 KiB of qkv read, 14 KiB of q and 4 KiB of K/V written; at R = 512,
18 MB per layer (~4 us at 4.3 TB/s).
"""

from __future__ import annotations

import functools

from numba import cuda
from numba.core import types

from . import CompileTarget
from .page_alloc import PAGE_SIZE


@functools.cache
def _rope_kv_write_rows_kernel(num_heads: int, num_kv_heads: int, head_dim: int):
    half = head_dim // 2
    k_start = num_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim

    @cuda.jit
    def rope_kv_write_rows(qkv, rope_cos, rope_sin, start, m, page_table, q, k_pages, v_pages):
        head = cuda.blockIdx.x
        row = cuda.blockIdx.y
        i = cuda.threadIdx.x
        if row >= m[0]:
            return
        p = start[0] + row
        if head < num_heads:
            x1 = qkv[row, head * head_dim + i]
            x2 = qkv[row, head * head_dim + half + i]
            c = rope_cos[p, i]
            s = rope_sin[p, i]
            q[row, head, i] = x1 * c - x2 * s
            q[row, head, half + i] = x2 * c + x1 * s
            return
        page = page_table[p // PAGE_SIZE]
        slot = p % PAGE_SIZE
        kv_head = head - num_heads
        if kv_head < num_kv_heads:
            x1 = qkv[row, k_start + kv_head * head_dim + i]
            x2 = qkv[row, k_start + kv_head * head_dim + half + i]
            c = rope_cos[p, i]
            s = rope_sin[p, i]
            k_pages[page, kv_head, slot, i] = x1 * c - x2 * s
            k_pages[page, kv_head, slot, half + i] = x2 * c + x1 * s
        else:
            kv_head -= num_kv_heads
            v_pages[page, kv_head, slot, i] = qkv[row, v_start + kv_head * head_dim + i]
            v_pages[page, kv_head, slot, half + i] = qkv[row, v_start + kv_head * head_dim + half + i]

    return rope_kv_write_rows


class RopeKvWriteRows:
    """RoPE + KV write of a chunk for one attention shape; `launch` enqueues it on a stream."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.kernel = _rope_kv_write_rows_kernel(num_heads, num_kv_heads, head_dim)
        self.heads = num_heads + 2 * num_kv_heads
        self.threads = head_dim // 2

    def launch(self, stream, qkv, rope_cos, rope_sin, start, m, page_table, q, k_pages, v_pages) -> None:
        """qkv float32 [R, q_size + 2 kv_size], rope_cos/rope_sin float32 [max_context, head_dim/2],
        start, m int32 [1] (m <= R), page_table int32 [max_pages] -> q float32 [>= R, num_heads,
        head_dim] rows 0 .. m - 1, and positions start .. start + m - 1 of k_pages, v_pages float16
        [num_pages, num_kv_heads, PAGE_SIZE, head_dim]."""
        self.kernel[(self.heads, qkv.shape[0]), self.threads, stream](qkv, rope_cos, rope_sin, start, m,
                                                                      page_table, q, k_pages, v_pages)


def make_rope_kv_write_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> RopeKvWriteRows:
    return RopeKvWriteRows(num_heads, num_kv_heads, head_dim)


def compile_targets() -> list[CompileTarget]:
    """The 7B attention shape (28 q heads, 4 kv heads, head_dim 128) and the tiny one."""
    i32 = types.int32[::1]
    pages = types.float16[:, :, :, ::1]
    signature = types.void(types.float32[:, ::1], types.float32[:, ::1], types.float32[:, ::1], i32, i32, i32,
                           types.float32[:, :, ::1], pages, pages)
    return [CompileTarget(f"rope_kv_write_rows[{heads}/{kv_heads}x{head_dim}]",
                          _rope_kv_write_rows_kernel(heads, kv_heads, head_dim), signature, ("cvt.rn.f16.f32",))
            for heads, kv_heads, head_dim in ((28, 4, 128), (4, 2, 64))]
