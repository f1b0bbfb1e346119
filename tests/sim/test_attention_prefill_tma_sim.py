"""dev/attention_prefill_kernels_tma.py (the product's prefill attention with a TMA ring, thread 0
filling, mbarriers instead of a block barrier a tile) in the simulator, on the product's simulator
cases (test_attention_prefill_sim.py: tiny shapes, NaN in every slot past the chunk and in q rows
>= m, a shuffled page table): within the float64 bound derived there, and bit for bit the product's
output (the same arithmetic in the same order; only the copies differ), whole and split.

Contexts of 1 to 90 keys put the last key anywhere in a page and in a tile: pages wholly past it are
not copied, the rest of the last tile's V rows are zeroed by the threads, and with one-tile segments
a walk of two tiles cycles its stages.
"""

import numpy as np
import pytest

from attention_prefill_kernels_tma import TmaPrefillAttention
from attention_prefill_oracle import run_case as run
from pynanoqwen.kernels.attention_prefill import KEY_TILE, make_prefill_attention
from pynanoqwen.ptx import SIMULATOR
from test_attention_prefill_sim import HEAD_DIM, M_CAP, MAX_PAGES, NUM_HEADS, NUM_KV_HEADS, check, random_case

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"


@pytest.mark.parametrize("split_rows", [0, M_CAP], ids=["whole", "split"])
def test_tma_ring_gives_the_products_bits(split_rows):
    rng = np.random.default_rng(3000 + split_rows)
    shape = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES)
    product = make_prefill_attention(*shape, segment_keys=KEY_TILE, split_rows=split_rows)
    variant = TmaPrefillAttention(*shape, segment_keys=KEY_TILE, split_rows=split_rows)
    for start, m in [(0, 1), (5, 7), (60, 7), (70, 20)]:
        case = random_case(rng, start, m)
        got, expected = run(variant, case, start, m), run(product, case, start, m)
        check(got, case, start, m, "TMA ring")
        assert np.array_equal(got.view(np.uint16), expected.view(np.uint16)), \
            f"start {start}, m {m}: {np.sum(got.view(np.uint16) != expected.view(np.uint16))} elements differ"
