"""Prefill attention (cp.async ring, Q K^T and P V on wgmma from swizzled K and V rings, online
softmax) in the CUDA simulator, against a float64 causal softmax attention over the gathered cache.

Tiny shapes: 4 query heads over 2 KV heads (GQA group 2: at query tile 16 two real warps and two
padding warps that only join their warpgroup's wgmmas; at 32 four real ones), head_dim 64 (the K
ring's 128-byte rows), M_cap 32 rows (two blocks of 16 positions, so short chunks leave a block
that must exit at once), 8 pages. The page table is a random permutation of a larger pool; every
cache slot outside positions 0..start+m-1, and every q row >= m, holds NaN, so reading a key the
causal mask excludes, a slot past the chunk or a wrong page poisons the output. One kernel object
serves every (start, m) in turn, as in a CUDA graph. Segments of one key tile (64 keys) make every
context of more than 64 keys fold; the split form (each segment a block, then the merge) must give
the whole kernel's bits.

Tolerance, derived per output element (not tuned). The reference takes q at the precision the
kernel feeds the tensor cores: fp16(q * log2(e) / sqrt(d)), with K and V exactly the fp16 cache.
What the kernel still rounds: the softmax weights to fp16 before P V (relative 2^-11 each, so at
most 2^-11 sum_j w_j |v_j| on the output), float32 sums (scores over d products, each row sum and
O accumulator over the keys, the rescalings: relative (keys + d + 4) 2^-23 of the same sum, and
scores off by up to Delta = d 2^-23 max_j sum_d |q_d k_jd| in log2 units, which moves the
normalised weights by a factor within 2^(+-2 Delta)), and the final fp16 store (2^-11 |out| plus
2^-25 for subnormals). The simulator's mma and wgmma are exact then rounded to float32, within
that bound.
"""


import numpy as np
import pytest

from attention_prefill_oracle import check_case, run_case as run
from attention_prefill_oracle import random_case as oracle_case
from pynanoqwen.kernels.attention_prefill import KEY_TILE, make_prefill_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
M_CAP = 32
MAX_PAGES = 8
POOL_PAGES = 11


def random_case(rng, start, m):
    return oracle_case(rng, start, m, (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), M_CAP, MAX_PAGES, POOL_PAGES)


def check(got, case, start, m, label):
    check_case(got, case, start, m, label, KEY_TILE)


@pytest.mark.parametrize("query_tile", [16, 32])
def test_prefill_attention_matches_causal_reference(query_tile):
    rng = np.random.default_rng(2000 + query_tile)
    attention = make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, query_tile=query_tile,
                                       segment_keys=KEY_TILE, split_rows=0)
    # Within the first tile, a chunk's rows straddling a tile (60, 7) and its block's second tile
    # reached by one warp only (70, 20: rows 70..85 and 86..89); at 32, two 16-row warps per head:
    # one past m, one straddling it.
    cases = [(0, 1), (0, 20), (5, 7), (16, 20), (60, 7), (70, 20)] if query_tile == 16 else [(5, 20)]
    for start, m in cases:
        case = random_case(rng, start, m)
        check(run(attention, case, start, m), case, start, m, f"query tile {query_tile}")


def test_split_segments_give_the_whole_kernels_bits():
    """Rows whose keys span 1 to 2 segments, rows that see none of a segment's keys (position 63 in a
    warp reaching 78), and a block past m: split and whole agree bit for bit, both within the bound."""
    rng = np.random.default_rng(2024)
    whole = make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, segment_keys=KEY_TILE, split_rows=0)
    split = make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, segment_keys=KEY_TILE,
                                   split_rows=M_CAP)
    for start, m in [(0, 20), (63, 16), (100, 20)]:
        case = random_case(rng, start, m)
        got_whole, got_split = run(whole, case, start, m), run(split, case, start, m)
        check(got_split, case, start, m, "split")
        assert np.array_equal(got_whole.view(np.uint16), got_split.view(np.uint16)), \
            f"start {start}, m {m}: {np.sum(got_whole.view(np.uint16) != got_split.view(np.uint16))} elements differ"


@pytest.mark.parametrize("segment_keys", [0, 32, 96])
def test_a_segment_that_is_not_whole_key_tiles_is_refused(segment_keys):
    from pynanoqwen.errors import ConfigError

    with pytest.raises(ConfigError, match="segment_keys"):
        make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, segment_keys=segment_keys)


def test_a_head_dim_that_is_not_whole_swizzle_rows_is_refused():
    from pynanoqwen.errors import ConfigError

    with pytest.raises(ConfigError, match="head_dim a multiple of 64"):
        make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, 96, MAX_PAGES)
