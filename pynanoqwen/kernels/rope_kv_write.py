"""RoPE on the new token's q and k, and the append of its k and v to the paged KV cache.

Input: `qkv` float32 [q_size + 2 kv_size], the QKV GEMV's output (bias included), laid out as
q heads, then k heads, then v heads, head_dim values each. At position p = pos[0]:

    q[h]  = rope(qkv q head h)                          float32 [num_heads, head_dim]
    k_pages[page, g, slot] = float16(rope(qkv k head g))  page = page_table[p // 16], slot = p % 16
    v_pages[page, g, slot] = float16(qkv v head g)

RoPE is Hugging Face's rotate_half convention (reference.apply_rope): element i pairs with
element i + head_dim/2, both rotated by the angle p * theta^(-2i/head_dim):

    out[i] = x[i] cos - x[i + d/2] sin,   out[i + d/2] = x[i + d/2] cos + x[i] sin

The angles come from tables made once on the host in float64 (`rope_cos_sin`, the same values
reference.rope_tables gives), not from a float32 angle computed here: position * inv_freq reaches
32767 radians, where a float32 angle would be off by up to 2e-3.

Launch: num_heads + 2 num_kv_heads blocks (36 at 7B), head_dim / 2 threads each. Block b handles
q head b, then k heads, then v heads; thread i handles the pair (i, i + head_dim/2). Tiny: 18 KiB
read, 16 KiB written at 7B; what matters is that it is one launch for all three jobs.
Measured on the H200 (bench's kernel table, 7B): 1.55 us a launch (43.4 us for the 28 of a step),
launch latency.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda
from numba.core import types

from ..reference import rope_tables
from . import CompileTarget
from .page_alloc import PAGE_SIZE


def rope_cos_sin(head_dim: int, theta: float, max_context: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [max_context, head_dim / 2]: the angles of every position.

    reference.rope_tables repeats the angles in both halves of a row; the kernel needs one half.
    """
    cos, sin = rope_tables(head_dim, theta, np.arange(max_context))
    half = head_dim // 2
    return np.ascontiguousarray(cos[:, :half]), np.ascontiguousarray(sin[:, :half])


@functools.cache
def _rope_kv_write_kernel(num_heads: int, num_kv_heads: int, head_dim: int):
    half = head_dim // 2
    k_start = num_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim

    @cuda.jit
    def rope_kv_write(qkv, rope_cos, rope_sin, pos, page_table, q, k_pages, v_pages):
        head = cuda.blockIdx.x
        i = cuda.threadIdx.x
        p = pos[0]
        if head < num_heads:
            x1 = qkv[head * head_dim + i]
            x2 = qkv[head * head_dim + half + i]
            c = rope_cos[p, i]
            s = rope_sin[p, i]
            q[head, i] = x1 * c - x2 * s
            q[head, half + i] = x2 * c + x1 * s
            return
        page = page_table[p // PAGE_SIZE]
        slot = p % PAGE_SIZE
        kv_head = head - num_heads
        if kv_head < num_kv_heads:
            x1 = qkv[k_start + kv_head * head_dim + i]
            x2 = qkv[k_start + kv_head * head_dim + half + i]
            c = rope_cos[p, i]
            s = rope_sin[p, i]
            k_pages[page, kv_head, slot, i] = x1 * c - x2 * s
            k_pages[page, kv_head, slot, half + i] = x2 * c + x1 * s
        else:
            kv_head -= num_kv_heads
            v_pages[page, kv_head, slot, i] = qkv[v_start + kv_head * head_dim + i]
            v_pages[page, kv_head, slot, half + i] = qkv[v_start + kv_head * head_dim + half + i]

    return rope_kv_write


class RopeKvWrite:
    """RoPE + KV append for one attention shape; `launch` enqueues it on a stream."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.kernel = _rope_kv_write_kernel(num_heads, num_kv_heads, head_dim)
        self.grid = num_heads + 2 * num_kv_heads
        self.threads = head_dim // 2

    def launch(self, stream, qkv, rope_cos, rope_sin, pos, page_table, q, k_pages, v_pages) -> None:
        """qkv float32 [q_size + 2 kv_size], rope_cos/rope_sin float32 [max_context, head_dim/2],
        pos int32 [1], page_table int32 [max_pages] -> q float32 [num_heads, head_dim] and one slot
        of k_pages, v_pages float16 [num_pages, num_kv_heads, PAGE_SIZE, head_dim]."""
        self.kernel[self.grid, self.threads, stream](qkv, rope_cos, rope_sin, pos, page_table, q,
                                                     k_pages, v_pages)


def make_rope_kv_write(num_heads: int, num_kv_heads: int, head_dim: int) -> RopeKvWrite:
    return RopeKvWrite(num_heads, num_kv_heads, head_dim)


def compile_targets() -> list[CompileTarget]:
    """The 7B attention shape (28 q heads, 4 kv heads, head_dim 128) and the tiny one."""
    pages = types.float16[:, :, :, ::1]
    signature = types.void(types.float32[::1], types.float32[:, ::1], types.float32[:, ::1], types.int32[::1],
                           types.int32[::1], types.float32[:, ::1], pages, pages)
    return [CompileTarget(f"rope_kv_write[{heads}/{kv_heads}x{head_dim}]",
                          _rope_kv_write_kernel(heads, kv_heads, head_dim), signature, ("cvt.rn.f16.f32",))
            for heads, kv_heads, head_dim in ((28, 4, 128), (4, 2, 64))]
