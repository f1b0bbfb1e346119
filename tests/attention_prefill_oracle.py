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
