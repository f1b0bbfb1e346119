"""The decode step's small kernels in the CUDA simulator, at tiny sizes, on fresh random inputs.

Oracles: float64 numpy for the arithmetic (RMSNorm), exact expectations for the data
movement (embedding, page allocation) and for token choice (argmax; for sampling, the
inverse-CDF / Gumbel-max choice computed in float64 from the same counter-based uniforms,
kernels.sampling.uniform_reference).
Block sizes are shrunk (Sampler keyword arguments) so the simulator, one Python thread per CUDA
thread, stays fast; the GPU shapes run in tests/test_engine_gpu.py.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.kernels.embedding import make_embedding
from pynanoqwen.kernels.page_alloc import PAGE_SIZE, make_page_alloc
from pynanoqwen.kernels.rmsnorm import make_rmsnorm, make_rmsnorm_rows
from pynanoqwen.kernels.sampling import Sampler, device_params, uniform_reference
from pynanoqwen.sampling import SamplingParams
from simulated import FP16_HALF_ULP, FP32_EPS, run

# The counter-based generator multiplies uint64 values modulo 2^64 on purpose; numpy scalars warn.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_embedding_copies_the_row_of_the_token_at_pos():
    rng = np.random.default_rng()
    vocab, hidden = 50, 96
    table = rng.standard_normal((vocab, hidden)).astype(np.float16)
    tokens = rng.integers(0, vocab, 8).astype(np.int32)
    position = int(rng.integers(0, 8))
    h = cuda.to_device(np.full(hidden, np.nan, np.float32))
    run(lambda s: make_embedding(hidden).launch(s, cuda.to_device(table), cuda.to_device(tokens),
                                                cuda.to_device(np.array([position], np.int32)), h))
    np.testing.assert_array_equal(h.copy_to_host(), table[tokens[position]].astype(np.float32))


@pytest.mark.parametrize("rows, hidden", [(1, 200), (1, 1100), (3, 512), (2, 300)])
def test_rmsnorm_matches_float64(rows, hidden):
    """One row on the decode block (fewer threads than elements, and more than 1024), several rows
    on the prefill one (elements a whole number of blocks of threads, and not)."""
    rng = np.random.default_rng()
    h = (rng.standard_normal((rows, hidden)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, hidden).astype(np.float16)
    eps = 1e-6
    xn = cuda.to_device(np.zeros((rows, hidden), np.float16))
    norm = make_rmsnorm(hidden, eps) if rows == 1 else make_rmsnorm_rows(hidden, eps)
    run(lambda s: norm.launch(s, cuda.to_device(h[0] if rows == 1 else h), cuda.to_device(weight),
                              xn[0] if rows == 1 else xn))
    h64 = h.astype(np.float64)
    expected = h64 / np.sqrt(np.mean(h64 * h64, axis=1, keepdims=True) + eps) * weight.astype(np.float64)
    got = xn.copy_to_host().astype(np.float64)
    # One FP16 rounding of the output, plus float32 arithmetic (sum of squares, rsqrt, products).
    np.testing.assert_array_less(np.abs(got - expected), (FP16_HALF_ULP + 64 * FP32_EPS) * np.abs(expected) + 2.0**-25)


def test_page_alloc_maps_the_new_page_to_the_next_free_one():
    rng = np.random.default_rng()
    table = rng.integers(0, 100, 8).astype(np.int32)
    free_pages = rng.permutation(100).astype(np.int32)  # a lease's order, not 0, 1, 2, ...
    logical = int(rng.integers(0, 8))
    taken = int(rng.integers(0, 99))
    d_table, d_taken = cuda.to_device(table), cuda.to_device(np.array([taken], np.int32))
    run(lambda s: make_page_alloc().launch(s, cuda.to_device(np.array([logical * PAGE_SIZE], np.int32)),
                                           d_table, cuda.to_device(free_pages), d_taken))
    expected = table.copy()
    expected[logical] = free_pages[taken]
    np.testing.assert_array_equal(d_table.copy_to_host(), expected)
    assert d_taken.copy_to_host()[0] == taken + 1


# ------------------------------------------------------------------------------------------------
# Sampling

SMALL = dict(candidates=16, sort_size=64, argmax_threads=64)


def sample_on_device(sampler: Sampler, method: str, logits: np.ndarray, params: SamplingParams, position: int):
    tokens = cuda.to_device(np.full(position + 2, -1, np.int32))
    pos = cuda.to_device(np.array([position], np.int32))
    sampling, top_k, seed = (cuda.to_device(a) for a in device_params(params))
    run(lambda s: sampler.launch(s, method, cuda.to_device(logits), sampling, top_k, seed, tokens, pos))
    assert pos.copy_to_host()[0] == position + 1
    got = tokens.copy_to_host()
    assert (got[:position + 1] == -1).all(), "only tokens[pos + 1] may be written"
    return int(got[position + 1])


def random_logits(rng, vocab):
    return (rng.standard_normal(vocab) * rng.uniform(1, 4)).astype(np.float32)


def test_argmax_is_exact_and_takes_the_lowest_id_among_equal_maxima():
    rng = np.random.default_rng()
    vocab = 1000
    sampler = Sampler(vocab, **SMALL)
    logits = random_logits(rng, vocab)
    ties = rng.choice(vocab, 3, replace=False)
    logits[ties] = logits.max() + 1
    position = int(rng.integers(0, 100))
    assert sample_on_device(sampler, "argmax", logits, SamplingParams(), position) == ties.min()
    assert ties.min() == np.argmax(logits)


def test_prompt_method_only_advances_pos():
    pos = cuda.to_device(np.array([7], np.int32))
    tokens = cuda.to_device(np.arange(10, dtype=np.int32))
    sampling, top_k, seed = (cuda.to_device(a) for a in device_params(SamplingParams()))
    sampler = Sampler(100, **SMALL)
    run(lambda s: sampler.launch(s, "prompt", cuda.to_device(np.zeros(100, np.float32)), sampling, top_k, seed,
                                 tokens, pos))
    assert pos.copy_to_host()[0] == 8
    np.testing.assert_array_equal(tokens.copy_to_host(), np.arange(10))


def test_temperature_sampling_is_the_gumbel_max_of_the_counter_uniforms():
    rng = np.random.default_rng()
    vocab = 700
    sampler = Sampler(vocab, **SMALL)
    for _ in range(2):
        logits = random_logits(rng, vocab)
        params = SamplingParams(temperature=float(rng.uniform(0.3, 2.0)), seed=int(rng.integers(0, 2**63)))
        position = int(rng.integers(0, 10000))
        got = sample_on_device(sampler, "argmax", logits, params, position)
        noise = -np.log(-np.log(uniform_reference(params.seed, position, np.arange(vocab))))
        perturbed = logits.astype(np.float64) / params.temperature + noise
        # float32 arithmetic on the device: the winner must be the float64 winner unless the two
        # best perturbed values are closer than the float32 error of computing them.
        best, second = np.sort(perturbed)[-2:][::-1]
        assert perturbed[got] >= best - 1e-4
        if best - second > 1e-4:
            assert got == int(np.argmax(perturbed))


def expected_candidate_draw(logits, params, u, candidates):
    """The token pynanoqwen.sampling defines, restricted to the top `candidates` logits, for uniform u;
    also how far u is from the nearest boundary of the inverse CDF (to skip float32-ambiguous draws)."""
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    z_vocab = np.exp(scaled - scaled[order[0]]).sum()
    k = min(params.top_k or candidates, candidates)
    order = order[:k]
    weights = np.exp(scaled[order] - scaled[order[0]])
    z = weights.sum() if params.top_k else z_vocab
    cdf = np.cumsum(weights)
    keep = int(np.sum(cdf[:-1] < params.top_p * z)) + 1
    cdf = cdf[:keep] / cdf[keep - 1]
    index = min(int(np.searchsorted(cdf, u, side="right")), keep - 1)
    nucleus_margin = np.min(np.abs(np.cumsum(weights)[:k] / z - params.top_p)) if params.top_p < 1 else 1.0
    return int(order[index]), min(np.min(np.abs(cdf - u)), nucleus_margin)


def test_each_slice_is_sorted_whole_by_the_partial_kernel():
    """candidates_partial at candidates = sort_size = 256: each list is its whole slice in order
    (larger logit, then lower id), the padding after it; its strides of 64 and 128 go through
    shared memory, the rest through shuffles. Ties included: 20 logits share one value. Then the
    draw among 256 candidates, whose running sum spans 4 warps and two chunks of 128 threads."""
    rng = np.random.default_rng()
    vocab, sort_size = 1900, 256
    sampler = Sampler(vocab, candidates=sort_size, sort_size=sort_size, argmax_threads=64)
    logits = random_logits(rng, vocab)
    logits[rng.choice(vocab, 20, replace=False)] = logits[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=int(rng.integers(0, 2**63)))
    token = sample_on_device(sampler, "candidates", logits, params, 5)
    values, indices = sampler.candidate_values.copy_to_host(), sampler.candidate_indices.copy_to_host()
    chunk = -(-vocab // sampler.lists)
    for slice_ in range(sampler.lists):
        ids = np.arange(slice_ * chunk, min(vocab, (slice_ + 1) * chunk))
        order = ids[np.argsort(-logits[ids], kind="stable")]
        got = indices[slice_ * sort_size:(slice_ + 1) * sort_size]
        np.testing.assert_array_equal(got[:len(order)], order)
        np.testing.assert_array_equal(values[slice_ * sort_size:slice_ * sort_size + len(order)], logits[order])
        assert (got[len(order):] >= vocab).all() and np.isneginf(values[slice_ * sort_size + len(order):
                                                                            (slice_ + 1) * sort_size]).all()
    # The draw, its running sum over 256 candidates scanned by 4 warps in two chunks of 128.
    expected, margin = expected_candidate_draw(logits, params, uniform_reference(params.seed, 5, vocab), sort_size)
    if margin > 1e-5:
        assert token == expected


# 300: 8 lists, merged by one candidates_merge block; 4096: 64 lists, 4 merge blocks of 16, whose
# 4 lists candidates_select merges; 16384: 256 lists, 16 merge blocks, 16 lists for the select (the
# GPU's shape at vocab 152064 and sort size 1024). Sorts of 64 pairs run in one warp's registers;
# of 256, the strides of 64 and 128 go through shared memory (as 4 of 10 sizes do at the GPU's 1024).
# Lists of 64 candidates (2100 at sort size 64: 64 lists, 4 merge blocks) merge their half
# strides below 64 in registers, as the GPU's 256 do.
@pytest.mark.parametrize("vocab, top_k, top_p, sort_size, candidates", [
    (300, 5, 1.0, 64, 16), (300, 0, 0.6, 64, 16), (300, 12, 0.8, 64, 16), (300, 40, 0.95, 64, 16),
    (4096, 0, 0.9, 64, 16), (4096, 10, 1.0, 64, 16), (4096, 0, 0.9, 256, 16), (2100, 0, 0.9, 64, 64),
    (16384, 0, 0.9, 64, 16)])
def test_candidate_sampling_matches_the_inverse_cdf_oracle(vocab, top_k, top_p, sort_size, candidates):
    rng = np.random.default_rng()
    sampler = Sampler(vocab, **{**SMALL, "sort_size": sort_size, "candidates": candidates})
    logits = random_logits(rng, vocab)
    params = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_k=top_k, top_p=top_p,
                            seed=int(rng.integers(0, 2**63)))
    position = int(rng.integers(0, 10000))
    got = sample_on_device(sampler, "candidates", logits, params, position)
    # Merge block b leaves the exact top `candidates` (larger logit, then lower id) of its group's
    # slices of the vocabulary in its list, in order.
    c = candidates
    group_logits = -(-vocab // sampler.lists) * (sampler.lists // sampler.merge_blocks)
    merged_values, merged_indices = sampler.merged_values.copy_to_host(), sampler.merged_indices.copy_to_host()
    lists = 1 << (-(-vocab // sort_size) - 1).bit_length()  # slices, rounded up to a power of two
    assert sampler.lists == lists and sampler.merge_blocks == max(1, lists // 16)
    for b in range(sampler.merge_blocks):
        ids = np.arange(b * group_logits, min(vocab, (b + 1) * group_logits))
        order = ids[np.argsort(-logits[ids], kind="stable")[:c]]
        np.testing.assert_array_equal(merged_indices[b * c:(b + 1) * c], order)
        np.testing.assert_array_equal(merged_values[b * c:(b + 1) * c], logits[order])
    expected, margin = expected_candidate_draw(logits, params, uniform_reference(params.seed, position, vocab),
                                               candidates)
    if margin > 1e-5:  # float32 vs float64 can only disagree at a boundary of the CDF or the nucleus
        assert got == expected
    else:
        assert got in np.argsort(-logits, kind="stable")[:candidates]
