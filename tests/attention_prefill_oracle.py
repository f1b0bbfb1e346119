"""The float64 oracle and error bound that the prefill attention tests (simulator and GPU) share.

Causal softmax attention of query rows 0..m-1 (positions start..start+m-1) over the cache gathered
through the page table, with q at the precision the kernel feeds the tensor cores. The per-element
tolerance is derived in the docstrings of tests/sim/test_attention_prefill_sim.py and
tests/test_attention_prefill_gpu.py (fp16 P, float32 sums and rescalings, score error Delta, the
final fp16 store); nothing in it is tuned.

The segment folds (kernels/attention_prefill.py) add, per segment a row's keys span, the rounding
of x_segment * b and of the fma into the running state (2 x 2^-23 relative) and ex2.approx's error
in each of the two scales a and b (~2^-22 each): 6 x 2^-23 a segment, a term of the bound.
"""

import math

import numpy as np

from pynanoqwen.kernels.attention_prefill import PAGE_SIZE, SEGMENT_KEYS


def reference_and_bound(q, k_pages, v_pages, page_table, start, m, segment_keys=SEGMENT_KEYS):
    """(expected, tolerance) float64 [m, heads * d] for q [M_cap, heads, d] and k/v pages
    [pages, kv heads, PAGE_SIZE, d]."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    q_scale = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    q_operand = (q[:m] * q_scale).astype(np.float16).astype(np.float64)  # log2-domain scores' q
    positions = np.arange(start + m)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    keys = k_pages[pages, :, slots].astype(np.float64)  # [positions, kv heads, d]
    values = v_pages[pages, :, slots].astype(np.float64)
    group = num_heads // num_kv_heads
    causal = positions[None, :] <= start + np.arange(m)[:, None]  # [row, key]
    count = causal.sum(axis=1)
    expected = np.empty((m, num_heads, head_dim))
    tolerance = np.empty((m, num_heads, head_dim))
    for h in range(num_heads):
        k, v = keys[:, h // group], values[:, h // group]
        scores = np.where(causal, q_operand[:, h] @ k.T, -np.inf)  # log2 units
        weights = np.exp2(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        expected[:, h] = weights @ v
        delta = head_dim * 2.0 ** -23 * np.where(causal, np.abs(q_operand[:, h]) @ np.abs(k).T, 0).max(axis=1)
        folds = -(-count // segment_keys)
        relative = 2.0 ** -11 + (count + head_dim + 4 + 6 * folds) * 2.0 ** -23 + np.expm1(2 * math.log(2) * delta)
        tolerance[:, h] = (weights @ np.abs(v)) * relative[:, None] + 2.0 ** -11 * np.abs(expected[:, h]) + 2.0 ** -25
    return expected.reshape(m, -1), tolerance.reshape(m, -1)


def random_case(rng, start, m, shape, m_cap, max_pages, pool_pages):
    """q [m_cap, heads, d] and K/V pools of `pool_pages` pages for shape (heads, kv heads, d), the
    table a random permutation of the pool; NaN in every slot outside positions 0..start+m-1 and in
    q past m, so reading a masked key, a slot past the chunk or a wrong page poisons the output."""
    num_heads, num_kv_heads, head_dim = shape
    pool = (pool_pages, num_kv_heads, PAGE_SIZE, head_dim)
    k_pages = np.full(pool, np.nan, np.float16)
    v_pages = np.full(pool, np.nan, np.float16)
    page_table = rng.permutation(pool_pages)[:max_pages].astype(np.int32)
    positions = np.arange(start + m)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k_pages[pages, :, slots] = rng.standard_normal((start + m, num_kv_heads, head_dim))
    v_pages[pages, :, slots] = rng.standard_normal((start + m, num_kv_heads, head_dim))
    q = np.full((m_cap, num_heads, head_dim), np.nan, np.float32)
    # Scaled so that the softmax is peaked enough to depend on every score.
    q[:m] = 3.0 * rng.standard_normal((m, num_heads, head_dim))
    return q, k_pages, v_pages, page_table


def run_case(attention, case, start, m):
    """The attention's output rows 0..m-1 for `case` (host arrays in, the pages in dim order, host
    array out)."""
    from numba import cuda

    from pynanoqwen.kernels.kv_layout import swizzle_rows

    q, k_pages, v_pages, page_table = case
    out = cuda.to_device(np.full((q.shape[0], q.shape[1] * q.shape[2]), np.nan, np.float16))
    attention.launch(cuda.stream(), cuda.to_device(q), cuda.to_device(swizzle_rows(k_pages)),
                     cuda.to_device(swizzle_rows(v_pages)),
                     cuda.to_device(page_table), cuda.to_device(np.array([start], np.int32)),
                     cuda.to_device(np.array([m], np.int32)), out)
    return out.copy_to_host()[:m]


def check_case(got, case, start, m, label, segment_keys):
    """Every output within its bound, or an assertion that says how many are not."""
    expected, tolerance = reference_and_bound(*case, start, m, segment_keys=segment_keys)
    error = np.abs(got.astype(np.float64) - expected)
    assert np.all(error <= tolerance), (f"start {start}, m {m}, {label}: max error {np.nanmax(error):.3g}, "
                                        f"{np.sum(~(error <= tolerance))} elements over their bound "
                                        f"(at most {tolerance.max():.3g})")
