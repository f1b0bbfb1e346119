"""RoPE on q and k of a run of tokens, and the write of their k and v into the paged KV cache:
the decode step's one token and a prefill chunk's rows, one kernel.

Input: `qkv` float32 [R, q_size + 2 kv_size], the QKV GEMV's or GEMM's output (bias included),
each row laid out as q heads, then k heads, then v heads, head_dim values each. Row i < m is the
token at position p = start + i:

    q[i, h] = rope(qkv[i] q head h, p)                           float32 [R, num_heads, head_dim]
    k_pages[page, g, slot] = float16(rope(qkv[i] k head g, p))   page = page_table[p // 16], slot = p % 16
    v_pages[page, g, slot] = float16(qkv[i] v head g)

(each slot's values in the order of kernels/kv_layout.py).

RoPE is Hugging Face's rotate_half convention (reference.apply_rope): element i pairs with
element i + head_dim/2, both rotated by the angle p * theta^(-2i/head_dim):

    out[i] = x[i] cos - x[i + d/2] sin,   out[i + d/2] = x[i + d/2] cos + x[i] sin

The angles come from tables made once on the host in float64 (`rope_cos_sin`, the same values
reference.rope_tables gives), not from a float32 angle computed here: position * inv_freq reaches
32767 radians, where a float32 angle would be off by up to 2e-3.

Who owns what: `start` and `m` are device arrays (int32 [1]), so one captured graph serves every
step or chunk. The decode step (`launch`) is the one-row case: its qkv [q_size + 2 kv_size] and q
[num_heads, head_dim] are viewed as one row, start is the engine's pos and m a constant 1. A
prefill chunk (`launch_rows`) passes its bucket's R rows; rows m .. R - 1 are padding and write
nothing: their positions may lie in pages that are not allocated (page_table holds stale entries
there), and their q is never read. Because both use the same kernel, a position's K/V come out
the same whether a prompt ran batched or token by token from the same qkv.

Launch: grid (R), THREADS threads. Block i handles row i: its THREADS // (head_dim / 2) groups of
head_dim / 2 threads take the heads (q heads, then k heads, then v heads) in turn, group g heads g,
g + groups, ...; thread t of a group the pair (t, t + head_dim / 2). Traffic at 7B per row: 18 KiB
of qkv read, 14 KiB of q and 4 KiB of K/V written; at R = 2048, 74 MB per layer (~17 us at 4.3
TB/s, ~24 at the H100's 3.0). A block a (head, row), 64 threads each, was the first form: 73728
blocks at R = 2048, and 89 us a layer on the H100, ~3.7x the bytes' time (docs/PERFORMANCE.md,
"2026-12-06, night": the prefill breakdown), since each block moved only 1.5 KiB; a block a row
moves 36 KiB and took 33 us a layer there (1.4x the bytes' time, "2026-12-06, late night"). Its
9 passes at 7B ran as a loop whose loads waited for the stores before them (they could alias, as
far as the compiler knew): now every pass's pair is loaded first, in one round trip, and a layer
takes 28 us at R = 2048 on the H100 (1.13x the bytes' time; "2026-12-07"). The arithmetic
of each element is the same in every form. The decode step no longer
launches it: the QKV GEMV's epilogue does the same for its one token (kernels/gemv_int4_kernel.py);
`launch` (one row) remains for validate's unit check of this kernel. Measured figures:
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32
from numba.core import types

from ..errors import ConfigError
from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..reference import rope_tables
from . import CompileTarget
from .kv_layout import check_head_dim, stored_dim
from .page_alloc import PAGE_SIZE


def rope_cos_sin(head_dim: int, theta: float, max_context: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [max_context, head_dim / 2]: the angles of every position.

    reference.rope_tables repeats the angles in both halves of a row; the kernel needs one half.
    """
    cos, sin = rope_tables(head_dim, theta, np.arange(max_context))
    half = head_dim // 2
    return np.ascontiguousarray(cos[:, :half]), np.ascontiguousarray(sin[:, :half])


THREADS = 256  # a block: one row, 4 heads at a time at head_dim 128


@functools.cache
def _rope_kv_write_kernel(num_heads: int, num_kv_heads: int, head_dim: int):
    half = head_dim // 2
    groups = THREADS // half  # heads rotated at once
    passes = -(-(num_heads + 2 * num_kv_heads) // groups)

    @cuda.jit
    def rope_kv_write(qkv, rope_cos, rope_sin, start, m, page_table, q, k_pages, v_pages):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        row = cuda.blockIdx.x
        if row >= m[0]:
            return
        group = cuda.threadIdx.x // half
        i = cuda.threadIdx.x % half
        p = start[0] + row
        c = rope_cos[p, i]
        s = rope_sin[p, i]
        page = page_table[p // PAGE_SIZE]
        slot = p % PAGE_SIZE
        # Every pass's pair is loaded before the first store: the stores (to q and the pages) could
        # alias qkv as far as the compiler knows, so loads written between them wait for them, one
        # round trip a pass. q, k and v heads lie one after another in a row: head h at h * head_dim.
        x1s = cuda.local.array(passes, float32)
        x2s = cuda.local.array(passes, float32)
        for step in range(passes):
            head = step * groups + group
            if head < num_heads + 2 * num_kv_heads:
                x1s[step] = qkv[row, head * head_dim + i]
                x2s[step] = qkv[row, head * head_dim + half + i]
        for step in range(passes):
            head = step * groups + group
            x1, x2 = x1s[step], x2s[step]
            if head < num_heads:
                q[row, head, i] = x1 * c - x2 * s
                q[row, head, half + i] = x2 * c + x1 * s
            elif head < num_heads + num_kv_heads:
                kv_head = head - num_heads
                k_pages[page, kv_head, slot, stored_dim(slot, i)] = x1 * c - x2 * s
                k_pages[page, kv_head, slot, stored_dim(slot, half + i)] = x2 * c + x1 * s
            elif head < num_heads + 2 * num_kv_heads:
                kv_head = head - num_heads - num_kv_heads
                v_pages[page, kv_head, slot, stored_dim(slot, i)] = x1
                v_pages[page, kv_head, slot, stored_dim(slot, half + i)] = x2

    return rope_kv_write


class RopeKvWrite:
    """RoPE + KV write for one attention shape; `launch` (one decode token) and `launch_rows`
    (a prefill chunk) enqueue it on a stream."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        check_head_dim(head_dim)
        if THREADS % (head_dim // 2):
            raise ConfigError(f"head_dim {head_dim}: {THREADS} threads are not whole groups of head_dim / 2")
        self.kernel = _rope_kv_write_kernel(num_heads, num_kv_heads, head_dim)
        self.one_row = cuda.to_device(np.ones(1, np.int32))  # the decode step's m, made once

    def launch_rows(self, stream, qkv, rope_cos, rope_sin, start, m, page_table, q, k_pages, v_pages) -> None:
        """qkv float32 [R, q_size + 2 kv_size], rope_cos/rope_sin float32 [max_context, head_dim/2],
        start, m int32 [1] (m <= R), page_table int32 [max_pages] -> q float32 [>= R, num_heads,
        head_dim] rows 0 .. m - 1, and positions start .. start + m - 1 of k_pages, v_pages float16
        [num_pages, num_kv_heads, PAGE_SIZE, head_dim]."""
        launch(self.kernel, (qkv.shape[0],), THREADS, stream,
               (qkv, rope_cos, rope_sin, start, m, page_table, q, k_pages, v_pages))

    def launch(self, stream, qkv, rope_cos, rope_sin, pos, page_table, q, k_pages, v_pages) -> None:
        """The decode step: qkv float32 [q_size + 2 kv_size] of the token at position pos[0] ->
        q float32 [num_heads, head_dim] and that position's slot of k_pages, v_pages."""
        self.launch_rows(stream, qkv.reshape(1, qkv.size), rope_cos, rope_sin, pos, self.one_row, page_table,
                         q.reshape(1, *q.shape), k_pages, v_pages)


def make_rope_kv_write(num_heads: int, num_kv_heads: int, head_dim: int) -> RopeKvWrite:
    return RopeKvWrite(num_heads, num_kv_heads, head_dim)


def compile_targets() -> list[CompileTarget]:
    """The 7B attention shape (28 q heads, 4 kv heads, head_dim 128) and the tiny one."""
    i32 = types.int32[::1]
    pages = types.float16[:, :, :, ::1]
    signature = types.void(types.float32[:, ::1], types.float32[:, ::1], types.float32[:, ::1], i32, i32, i32,
                           types.float32[:, :, ::1], pages, pages)
    return [CompileTarget(f"rope_kv_write[{heads}/{kv_heads}x{head_dim}]",
                          _rope_kv_write_kernel(heads, kv_heads, head_dim), signature, ("cvt.rn.f16.f32",))
            for heads, kv_heads, head_dim in ((28, 4, 128), (4, 2, 64))]
