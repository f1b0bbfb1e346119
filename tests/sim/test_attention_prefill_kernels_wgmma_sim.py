"""dev/attention_prefill_kernels_wgmma.py (the product's prefill attention with Q K^T on wgmma) in
the CUDA simulator: both forms against the float64 causal reference, and the split form's bits
against the whole form's, as tests/sim/test_attention_prefill_sim.py checks the product.

Tiny shapes: 4 query heads over 2 KV heads (GQA group 2: at query tile 16 two real warps and two
that only join their warpgroup's wgmmas; at 32 four real ones), head_dim 64 (the K ring's 128-byte
rows), M_cap 32, 8 pages. Segments of one key tile (64 keys), so every context of more than 64
keys folds. NaN in every cache slot outside positions 0..start+m-1 and in q past m. The tolerance
is attention_prefill_oracle's derived bound (the module docstring of the product's test).
"""

import numpy as np
import pytest

from attention_prefill_kernels_wgmma import KEY_TILE, WgmmaPrefillAttention
from attention_prefill_oracle import check_case, run_case as run
from attention_prefill_oracle import random_case as oracle_case

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
M_CAP = 32
MAX_PAGES = 8
POOL_PAGES = 11


def random_case(rng, start, m):
    return oracle_case(rng, start, m, (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), M_CAP, MAX_PAGES, POOL_PAGES)


def check(got, case, start, m, label):
    check_case(got, case, start, m, label, KEY_TILE)


@pytest.mark.parametrize("query_tile, cases", [(16, [(0, 1), (0, 20), (60, 7), (70, 20)]), (32, [(5, 20)])])
def test_wgmma_prefill_attention_matches_causal_reference(query_tile, cases):
    rng = np.random.default_rng()
    attention = WgmmaPrefillAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, query_tile=query_tile,
                                      segment_keys=KEY_TILE, split_rows=0)
    for start, m in cases:
        case = random_case(rng, start, m)
        check(run(attention, case, start, m), case, start, m, f"query tile {query_tile}")


def test_wgmma_split_segments_give_the_whole_kernels_bits():
    """Rows over 1 to 2 segments, rows that see none of a segment's keys (position 63 in a warp
    reaching 78), a block past m: split and whole agree bit for bit, the split within the bound."""
    rng = np.random.default_rng()
    whole = WgmmaPrefillAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, segment_keys=KEY_TILE, split_rows=0)
    split = WgmmaPrefillAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, segment_keys=KEY_TILE,
                                  split_rows=M_CAP)
    for start, m in [(0, 20), (63, 16), (100, 20)]:
        case = random_case(rng, start, m)
        got_whole, got_split = run(whole, case, start, m), run(split, case, start, m)
        check(got_split, case, start, m, "split")
        assert np.array_equal(got_whole.view(np.uint16), got_split.view(np.uint16)), \
            f"start {start}, m {m}: {np.sum(got_whole.view(np.uint16) != got_split.view(np.uint16))} elements differ"
