"""The prefill path's row kernels in the CUDA simulator, at tiny sizes, on fresh random inputs.

Oracles: float64 numpy for the arithmetic (RMSNorm, RoPE), exact expectations for the data
movement (embedding rows, page allocation, the hand-over row), and the decode kernels
themselves for what decode must find after a prefill: a prompt written in chunks (page_alloc_range
+ rope_kv_write's launch_rows) leaves the page table, the allocator and the KV pages bit for bit
as the decode step's page_alloc + rope_kv_write's one-token launch would at every position. Every
chunk is smaller than its bucket (R rows), so each test also checks that padding rows write
nothing they must not.
RoPE and the KV write are tests/sim/test_rope_kv_write_sim.py, the tensor-core GEMMs
tests/sim/test_gemm_sim.py; the engine-level prefill runs on the GPU only (tests/test_prefill_gpu.py).
"""

import numpy as np
from numba import cuda

from pynanoqwen.kernels.embedding_prefill import make_embedding_rows
from pynanoqwen.kernels.last_row_prefill import make_last_row
from pynanoqwen.kernels.page_alloc import PAGE_SIZE, make_page_alloc
from pynanoqwen.kernels.page_alloc_prefill import make_page_alloc_range
from pynanoqwen.kernels.rmsnorm import make_rmsnorm_rows
from pynanoqwen.kernels.rope_kv_write import make_rope_kv_write, rope_cos_sin
from simulated import FP16_HALF_ULP, FP32_EPS, run, device_int


def test_embedding_rows_copies_the_chunk_and_zeroes_the_padding():
    rng = np.random.default_rng()
    vocab, hidden, rows = 40, 160, 6  # hidden is not a multiple of the 128-thread block
    table = rng.standard_normal((vocab, hidden)).astype(np.float16)
    tokens = rng.integers(0, vocab, 20).astype(np.int32)
    start, m = int(rng.integers(0, 14)), int(rng.integers(1, rows))
    h = cuda.to_device(np.full((rows, hidden), np.nan, np.float32))
    run(lambda s: make_embedding_rows(hidden).launch(s, cuda.to_device(table), cuda.to_device(tokens),
                                                     device_int(start), device_int(m), h))
    got = h.copy_to_host()
    np.testing.assert_array_equal(got[:m], table[tokens[start:start + m]].astype(np.float32))
    np.testing.assert_array_equal(got[m:], 0.0)


def test_rmsnorm_rows_matches_float64_per_row():
    rng = np.random.default_rng()
    for hidden in (200, 600):  # fewer threads than the 256 maximum, and more elements than threads
        rows, eps = 3, 1e-6
        h = (rng.standard_normal((rows, hidden)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        weight = rng.uniform(0.5, 1.5, hidden).astype(np.float16)
        xn = cuda.to_device(np.zeros((rows + 1, hidden), np.float16))  # one row past R: left alone
        run(lambda s: make_rmsnorm_rows(hidden, eps).launch(s, cuda.to_device(h), cuda.to_device(weight), xn))
        h64 = h.astype(np.float64)
        expected = h64 / np.sqrt(np.mean(h64 * h64, axis=1, keepdims=True) + eps) * weight.astype(np.float64)
        got = xn.copy_to_host()
        # One FP16 rounding of the output, plus float32 arithmetic (sum of squares, rsqrt, products).
        np.testing.assert_array_less(np.abs(got[:rows].astype(np.float64) - expected),
                                     (FP16_HALF_ULP + 64 * FP32_EPS) * np.abs(expected) + 2.0**-25)
        np.testing.assert_array_equal(got[rows], 0.0)


def test_page_alloc_range_over_chunks_builds_the_table_decode_would():
    """Chunks from position `cached` (0, or the pages a prefix-cache lease reuses, already in the
    table), over a shuffled free list: the table m decode steps would build, taken in list order."""
    rng = np.random.default_rng()
    max_pages = 20
    for _ in range(3):
        cached = PAGE_SIZE * int(rng.integers(0, 4))
        n = int(rng.integers(cached + 1, max_pages * PAGE_SIZE))
        inner = np.arange(cached + 1, n)
        cuts = np.sort(rng.choice(inner, size=min(len(inner), int(rng.integers(0, 5))), replace=False))
        sentinel = rng.integers(1000, 2000, max_pages).astype(np.int32)  # stale entries of a former sequence
        free_pages = cuda.to_device(rng.permutation(max_pages).astype(np.int32))
        table, taken = cuda.to_device(sentinel), cuda.to_device(np.zeros(1, np.int32))
        alloc = make_page_alloc_range()
        for start, end in zip([cached, *cuts], [*cuts, n]):
            run(lambda s: alloc.launch(s, device_int(int(start)), device_int(int(end - start)), table, free_pages,
                                       taken))
        # Decode: page_alloc at every position that starts a page, one step at a time.
        decode_table, decode_taken = cuda.to_device(sentinel), cuda.to_device(np.zeros(1, np.int32))
        for position in range(cached, n, PAGE_SIZE):
            run(lambda s: make_page_alloc().launch(s, device_int(position), decode_table, free_pages, decode_taken))
        np.testing.assert_array_equal(table.copy_to_host(), decode_table.copy_to_host())
        np.testing.assert_array_equal(table.copy_to_host()[:cached // PAGE_SIZE], sentinel[:cached // PAGE_SIZE])
        started = -(-n // PAGE_SIZE) - cached // PAGE_SIZE
        np.testing.assert_array_equal(table.copy_to_host()[cached // PAGE_SIZE:-(-n // PAGE_SIZE)],
                                      free_pages.copy_to_host()[:started])
        assert taken.copy_to_host()[0] == decode_taken.copy_to_host()[0] == started


def test_chunked_kv_write_leaves_the_pages_decode_would():
    """Two chunks of prefill and n decode steps, from the same qkv rows: identical K/V pages."""
    rng = np.random.default_rng()
    heads, kv_heads, head_dim, max_context = 2, 1, 64, 64  # 64: the pages' layout spans 64 dims
    pages, rows = max_context // PAGE_SIZE, 32
    n = int(rng.integers(PAGE_SIZE + 2, 2 * rows))
    cut = int(rng.integers(max(1, n - rows), min(rows, n - 1) + 1))  # two chunks, each fits R = 32 rows
    qkv = rng.standard_normal((n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    cos, sin = (cuda.to_device(a) for a in rope_cos_sin(head_dim, 1e6, max_context))
    shape = (pages, kv_heads, PAGE_SIZE, head_dim)
    init = rng.standard_normal(shape).astype(np.float16)

    free_pages = cuda.to_device(np.arange(pages, dtype=np.int32))
    table, free = cuda.to_device(np.zeros(pages, np.int32)), cuda.to_device(np.zeros(1, np.int32))
    k_rows, v_rows = cuda.to_device(init), cuda.to_device(init)
    q_rows = cuda.device_array((rows, heads, head_dim), np.float32)
    for start, end in ((0, cut), (cut, n)):
        chunk = np.zeros((rows, qkv.shape[1]), np.float32)
        chunk[:end - start] = qkv[start:end]
        chunk[end - start:] = rng.standard_normal((rows - (end - start), qkv.shape[1]))  # padding: must not land
        first, m = device_int(start), device_int(end - start)
        run(lambda s: make_page_alloc_range().launch(s, first, m, table, free_pages, free))
        run(lambda s: make_rope_kv_write(heads, kv_heads, head_dim).launch_rows(
            s, cuda.to_device(chunk), cos, sin, first, m, table, q_rows, k_rows, v_rows))

    decode_table, decode_free = cuda.to_device(np.zeros(pages, np.int32)), cuda.to_device(np.zeros(1, np.int32))
    k_steps, v_steps = cuda.to_device(init), cuda.to_device(init)
    q_step = cuda.device_array((heads, head_dim), np.float32)
    for position in range(n):
        pos = device_int(position)
        if position % PAGE_SIZE == 0:
            run(lambda s: make_page_alloc().launch(s, pos, decode_table, free_pages, decode_free))
        run(lambda s: make_rope_kv_write(heads, kv_heads, head_dim).launch(
            s, cuda.to_device(qkv[position]), cos, sin, pos, decode_table, q_step, k_steps, v_steps))
    np.testing.assert_array_equal(table.copy_to_host(), decode_table.copy_to_host())
    np.testing.assert_array_equal(k_rows.copy_to_host(), k_steps.copy_to_host())
    np.testing.assert_array_equal(v_rows.copy_to_host(), v_steps.copy_to_host())


def test_last_row_hands_the_chunk_over_to_decode():
    rng = np.random.default_rng()
    hidden, rows = 200, 8
    h_rows = rng.standard_normal((rows, hidden)).astype(np.float32)
    start, m = int(rng.integers(0, 100)), int(rng.integers(1, rows + 1))
    h, pos = cuda.to_device(np.full(hidden, np.nan, np.float32)), device_int(-1)
    run(lambda s: make_last_row(hidden).launch(s, cuda.to_device(h_rows), device_int(start), device_int(m), h, pos))
    np.testing.assert_array_equal(h.copy_to_host(), h_rows[m - 1])
    assert pos.copy_to_host()[0] == start + m - 1
