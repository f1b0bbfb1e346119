"""Decode attention (producer warp + bulk copies + mbarriers + consumer warps + split merge) in
the CUDA simulator, against plain float64 softmax attention over the gathered cache.

Tiny shapes: 4 query heads over 2 KV heads (GQA group 2), head_dim 64. The page table is a
random permutation of a pool larger than needed, and every cache slot that is not part of the
context (the tail of the last page, pages not in the table) holds NaN, so reading past the
context or through the wrong page poisons the output. num_splits 3 with one page a split leaves
some splits without pages at short contexts; a 2-stage ring makes the producer wait for a
consumer to release a stage before refilling it (one consumer: both stages its own), and 4 stages
over 2 consumers give each one a page in flight while it computes the other. One kernel object serves every context in
turn, as in a CUDA graph, so the merge counter must reset itself.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.errors import ConfigError
from pynanoqwen.kernels.attention_decode import PAGE_SIZE, make_decode_attention
from pynanoqwen.kernels.kv_layout import swizzle_rows

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_PAGES = 4
POOL_PAGES = 7


def reference_attention(q, k_pages, v_pages, page_table, pos):
    """softmax(q K^T / sqrt(d)) V in float64, over positions 0..pos gathered through the table."""
    positions = np.arange(pos + 1)
    pages = page_table[positions // PAGE_SIZE]
    keys = k_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)  # [ctx, kv_heads, d]
    values = v_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)
    group = q.shape[0] // keys.shape[1]
    out = np.empty(q.shape, np.float64)
    for h in range(q.shape[0]):
        scores = keys[:, h // group] @ q[h].astype(np.float64) / np.sqrt(q.shape[1])
        weights = np.exp(scores - scores.max())
        out[h] = weights @ values[:, h // group] / weights.sum()
    return out.reshape(-1)


def random_cache(rng, context):
    """K/V pools in a shuffled page order, NaN everywhere outside positions 0..context-1 (each
    slot's values in dim order: the launch stores them in kernels/kv_layout.py's)."""
    shape = (POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_pages = np.full(shape, np.nan, np.float16)
    v_pages = np.full(shape, np.nan, np.float16)
    page_table = rng.permutation(POOL_PAGES)[:MAX_PAGES].astype(np.int32)
    for position in range(context):
        page, slot = page_table[position // PAGE_SIZE], position % PAGE_SIZE
        k_pages[page, :, slot] = rng.standard_normal((NUM_KV_HEADS, HEAD_DIM))
        v_pages[page, :, slot] = rng.standard_normal((NUM_KV_HEADS, HEAD_DIM))
    return k_pages, v_pages, page_table


# Splits with several consumers, one consumer alone, and a ring deeper than the consumers: each
# setting appears with a change of the others (2-6 s a case on 2 cores).
@pytest.mark.parametrize("num_splits, stages, consumers", [(3, 2, 2), (1, 2, 1), (1, 4, 2)])
def test_decode_attention_matches_softmax_reference(num_splits, stages, consumers):
    matches_softmax_reference(make_decode_attention, num_splits, stages, consumers)


@pytest.mark.parametrize("num_splits, stages, consumers", [(3, 2, 2), (1, 4, 2)])
def test_cluster_merge_variant_with_one_block_clusters(num_splits, stages, consumers):
    """dev/attention_cluster_merge.py in clusters of one block (the simulator runs blocks one at a
    time): the leader's merge and, with several splits holding pages, the leaders' global merge."""
    from attention_cluster_merge import load_variant

    matches_softmax_reference(load_variant(cluster=1).make_decode_attention, num_splits, stages, consumers)


@pytest.mark.parametrize("num_splits, stages, consumers", [(3, 2, 2)])
def test_one_fence_variant_matches_softmax_reference(num_splits, stages, consumers):
    """dev/attention_one_fence.py: the split's partial published by thread 0's fence alone."""
    from attention_one_fence import load_variant

    matches_softmax_reference(load_variant().make_decode_attention, num_splits, stages, consumers)


def test_packed_halves_variant_matches_softmax_reference():
    """dev/attention_packed_halves.py: P's FP16 remainder in the P V mma's rows 8..15."""
    from attention_packed_halves import load_variant

    matches_softmax_reference(load_variant().make_decode_attention, *TINY)


@pytest.mark.parametrize("form", ["no P V", "copies only"])
def test_page_phase_forms_finish_and_write_every_output(form):
    """dev/attention_page_phase.py's forms leave consumer work out (their values are wrong on
    purpose) but must keep the ring's handshake: every launch ends and writes every element."""
    from attention_page_phase import load_variant

    attention = tiny(load_variant(form).make_decode_attention)
    rng = np.random.default_rng()
    sentinel = np.float16(12345.0)
    for context in (5, 40):
        out, _ = launch_case(attention, rng, context, poison=sentinel)
        assert not np.any(out == sentinel), f"{form}, context {context}: an element not written"


TINY = (3, 2, 2)  # num_splits, stages, consumers of the variants' simulator tests


def tiny(make):
    """A kernel of `make` at the simulator's shapes and TINY's launch, one page a split."""
    num_splits, stages, consumers = TINY
    return make(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, num_splits=num_splits, stages=stages,
                consumers=consumers, min_pages_per_split=1)


def launch_case(attention, rng, context, poison=np.nan):
    """(attn, float64 reference) of one launch over a fresh random cache of `context` positions,
    attn's buffer filled with `poison` before the launch."""
    k_pages, v_pages, page_table = random_cache(rng, context)
    # Scaled so that the softmax is peaked enough to depend on every score.
    q = (3.0 * rng.standard_normal((NUM_HEADS, HEAD_DIM))).astype(np.float32)
    pos = np.array([context - 1], np.int32)
    out = cuda.to_device(np.full(NUM_HEADS * HEAD_DIM, poison, np.float16))
    attention.launch(cuda.stream(), cuda.to_device(q), cuda.to_device(swizzle_rows(k_pages)),
                     cuda.to_device(swizzle_rows(v_pages)), cuda.to_device(page_table), cuda.to_device(pos), out)
    return out.copy_to_host(), reference_attention(q, k_pages, v_pages, page_table, context - 1)


def matches_softmax_reference(make, num_splits, stages, consumers):
    rng = np.random.default_rng()
    attention = make(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, num_splits=num_splits, stages=stages,
                     consumers=consumers, min_pages_per_split=1)
    for context in (1, 5, 16, 17, 40):
        out, expected = launch_case(attention, rng, context)
        # float16 output: 2e-3 is four half-ULPs at 1.0; the float32 math inside is far finer (q and
        # the weights enter the mma as FP16 high parts plus FP16 remainders: ~2^-22 relative).
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-3, atol=2e-3,
                                   err_msg=f"context {context}, num_splits {num_splits}")


def test_stages_must_be_a_multiple_of_consumers():
    with pytest.raises(ConfigError, match="multiple of consumers"):
        make_decode_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, stages=2, consumers=3)
