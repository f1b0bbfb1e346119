"""dev/attention_prefill_wgmma.py (prefill attention with Q K^T, and in its second form P V too, on
wgmma) in the CUDA simulator, against pynanoqwen.oracles.attention_oracle (float64 causal
attention, its fp16-operand bound).

Tiny shapes that still need the variant's structure: head_dim 64 (one 128-byte slab of the
swizzled K ring), and 5 query heads over 1 KV head, so the block's 8 warps are two warpgroups, the
second with three warps past the group (computing head 4's scores again, storing nothing). The
chunk is the variant's own random_chunk: shuffled pages, NaN in every slot outside positions
0..start+m-1 and in every q row >= m, so a key the mask excludes, a slot past the chunk, a wrong
page or a wrong swizzle position (of K, or of P) poisons the output. Contexts of several key tiles
(32 or 64 keys) exercise the ring's two stages and the online softmax's rescaling, which P V on
wgmma applies through shared memory.
"""

import numpy as np
import pytest
from numba import cuda

from attention_prefill_wgmma import KEY_TILES, WgmmaAttention, device_chunk, expected_and_bound, random_chunk

SHAPE = (5, 1, 64)  # query heads, KV heads, head_dim
M_CAP = 32  # two blocks of 16 positions


@pytest.mark.parametrize("pv_wgmma", [False, True], ids=["qk", "qk_pv"])
@pytest.mark.parametrize("key_tile", KEY_TILES)
@pytest.mark.parametrize("start, m", [(0, 1), (0, 20), (9, 7), (40, 20), (70, 18)])
def test_wgmma_prefill_attention_matches_float64(start, m, key_tile, pv_wgmma):
    rng = np.random.default_rng(3000 + 97 * start + m + key_tile)
    chunk = random_chunk(rng, start, m, M_CAP, 6, SHAPE)
    out = cuda.to_device(np.full((M_CAP, SHAPE[0] * SHAPE[2]), np.nan, np.float16))
    WgmmaAttention(*SHAPE, key_tile, pv_wgmma=pv_wgmma).launch(cuda.stream(), *device_chunk(chunk, start, m), out)
    got = out.copy_to_host()
    expected, bound = expected_and_bound(chunk, start, m)
    error = np.abs(got[:m].astype(np.float64) - expected)
    assert np.all(error <= bound), (f"start {start}, m {m}: max error / bound {np.nanmax(error / bound):.3g}, "
                                    f"{np.sum(~(error <= bound))} elements over")
    assert np.all(np.isnan(got[m:])), "a row past m was written"
