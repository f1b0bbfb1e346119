"""RoPE and the KV-cache write (kernels/rope_kv_write.py) in the CUDA simulator, at tiny sizes, on
fresh random inputs: a prefill chunk of rows (launch_rows, with padding rows that must write
nothing) and the decode step's one token (launch, the one-row case), against one float64 oracle.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.kernels.kv_layout import swizzle_rows
from pynanoqwen.kernels.page_alloc import PAGE_SIZE
from pynanoqwen.kernels.rope_kv_write import make_rope_kv_write, rope_cos_sin
from simulated import FP16_HALF_ULP, FP32_EPS, run, device_int


def rope64(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """rotate_half RoPE in float64 of x [rows, heads, head_dim] at one position per row."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
    angle = (positions[:, None] * inv_freq)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (10, 2, 128)])
def test_a_chunk_is_rotated_and_written_at_its_positions_only(heads, kv_heads, head_dim):
    """One pass of the block's head groups (8 heads of 64 dims in 256 threads), and four, the last
    partial (14 heads of 128 dims, 4 at a time), as the 7B shape takes 9."""
    rng = np.random.default_rng()
    max_context, theta = 96, 10000.0
    half, pages, rows = head_dim // 2, max_context // PAGE_SIZE, 24
    start, m = int(rng.integers(0, 40)), int(rng.integers(1, rows))  # m < R: padding rows exist
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    page_table = rng.permutation(pages).astype(np.int32)
    cos, sin = rope_cos_sin(head_dim, theta, max_context)
    k_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, head_dim)).astype(np.float16)
    v_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, head_dim)).astype(np.float16)
    q_init = np.full((rows, heads, head_dim), np.nan, np.float32)
    q, k_pages, v_pages = (cuda.to_device(a) for a in (q_init, k_init, v_init))
    run(lambda s: make_rope_kv_write(heads, kv_heads, head_dim).launch_rows(
        s, cuda.to_device(qkv), cuda.to_device(cos), cuda.to_device(sin), device_int(start), device_int(m),
        cuda.to_device(page_table), q, k_pages, v_pages))

    positions = np.arange(start, start + m)
    parts = qkv[:m].astype(np.float64).reshape(m, heads + 2 * kv_heads, head_dim)
    pair_size = np.tile(np.abs(parts[..., :half]) + np.abs(parts[..., half:]), 2)  # |x1| + |x2| bounds each output
    q_expected = rope64(parts[:, :heads], positions, theta)
    k_expected = rope64(parts[:, heads:heads + kv_heads], positions, theta)
    v_expected = parts[:, heads + kv_heads:]
    q_got = q.copy_to_host()
    # cos/sin are float32 (one rounding each), then two products and a sum in float32.
    np.testing.assert_array_less(np.abs(q_got[:m] - q_expected), 8 * FP32_EPS * pair_size[:, :heads] + 1e-30)
    assert np.isnan(q_got[m:]).all(), "padding rows wrote q"
    # In dim order (kernels/kv_layout.py), the init too, so that untouched slots compare alike.
    k_got, v_got = swizzle_rows(k_pages.copy_to_host()), swizzle_rows(v_pages.copy_to_host())
    k_init, v_init = swizzle_rows(k_init), swizzle_rows(v_init)
    page, slot = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    np.testing.assert_array_less(np.abs(k_got[page, :, slot].astype(np.float64) - k_expected),
                                 FP16_HALF_ULP * np.abs(k_expected) + 8 * FP32_EPS * pair_size[:, heads:heads + kv_heads]
                                 + 2.0**-25)
    np.testing.assert_array_equal(v_got[page, :, slot], v_expected.astype(np.float16))
    untouched = np.ones(k_init.shape[:3], bool)
    untouched[page, :, slot] = False
    np.testing.assert_array_equal(k_got[untouched], k_init[untouched])
    np.testing.assert_array_equal(v_got[untouched], v_init[untouched])


def test_one_decode_token_is_the_one_row_case():
    """launch(): a 1-D qkv at position pos[0] -> q [heads, head_dim] and that position's slot."""
    rng = np.random.default_rng()
    heads, kv_heads, head_dim, max_context, theta = 4, 2, 64, 64, 10000.0
    half, pages = head_dim // 2, max_context // PAGE_SIZE
    position = int(rng.integers(0, max_context))
    qkv = rng.standard_normal((heads + 2 * kv_heads) * head_dim).astype(np.float32)
    page_table = rng.permutation(pages).astype(np.int32)
    cos, sin = rope_cos_sin(head_dim, theta, max_context)
    k_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, head_dim)).astype(np.float16)
    v_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, head_dim)).astype(np.float16)
    q, k_pages, v_pages = (cuda.to_device(a) for a in (np.zeros((heads, head_dim), np.float32), k_init, v_init))
    run(lambda s: make_rope_kv_write(heads, kv_heads, head_dim).launch(
        s, cuda.to_device(qkv), cuda.to_device(cos), cuda.to_device(sin), device_int(position),
        cuda.to_device(page_table), q, k_pages, v_pages))

    parts = qkv.astype(np.float64).reshape(1, heads + 2 * kv_heads, head_dim)
    pair_size = np.tile(np.abs(parts[..., :half]) + np.abs(parts[..., half:]), 2)[0]
    rotated = rope64(parts, np.array([position]), theta)[0]
    np.testing.assert_array_less(np.abs(q.copy_to_host() - rotated[:heads]), 8 * FP32_EPS * pair_size[:heads] + 1e-30)
    page, slot = page_table[position // PAGE_SIZE], position % PAGE_SIZE
    # In dim order (kernels/kv_layout.py), the init too, so that untouched slots compare alike.
    k_got, v_got = swizzle_rows(k_pages.copy_to_host()), swizzle_rows(v_pages.copy_to_host())
    k_init, v_init = swizzle_rows(k_init), swizzle_rows(v_init)
    k_rot = rotated[heads:heads + kv_heads]
    np.testing.assert_array_less(np.abs(k_got[page, :, slot].astype(np.float64) - k_rot),
                                 FP16_HALF_ULP * np.abs(k_rot) + 8 * FP32_EPS * pair_size[heads:heads + kv_heads]
                                 + 2.0**-25)
    np.testing.assert_array_equal(v_got[page, :, slot], parts[0, heads + kv_heads:].astype(np.float16))
    untouched = np.ones(k_init.shape[:3], bool)
    untouched[page, :, slot] = False
    np.testing.assert_array_equal(k_got[untouched], k_init[untouched])
    np.testing.assert_array_equal(v_got[untouched], v_init[untouched])
