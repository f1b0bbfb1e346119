"""The prefill GEMM's tile choice (kernels/gemm_int4.default_tiles_for), without a GPU: at every
model size and prefill bucket each linear gets one of the product's tiles, all deterministic
(split-K by atomic adds, whose order would make a prompt's logits differ from run to run and graph
runs from eager ones, is dev/gemm_wgmma_split_k.py's), one that fits its shape, and all of a
linear's summing a row alike."""

import pytest

from pynanoqwen.config import PRESETS
from pynanoqwen.engine import PREFILL_BUCKETS
from pynanoqwen.kernels.gemm_int4_tiles import TILE_NAMES, default_tiles_for, matrices_of


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_bucket_gets_a_deterministic_tile_that_fits(preset):
    for _, n, k, epilogue in PRESETS[preset].engine_linears:
        for m in PREFILL_BUCKETS:
            tiles = default_tiles_for(m, n, k, epilogue)
            assert tiles in TILE_NAMES, (preset, n, k, epilogue, m, tiles)
            assert tiles.fits(n, k, matrices_of(epilogue)), (preset, n, k, epilogue, m, TILE_NAMES[tiles])


def test_7b_prompts_of_every_length_run_on_wgmma():
    from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile

    for _, n, k, epilogue in PRESETS["7b"].engine_linears:
        assert all(isinstance(default_tiles_for(m, n, k, epilogue), WgmmaTile) for m in PREFILL_BUCKETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_model_sums_a_row_alike_at_every_bucket(preset):
    """The prefix cache reuses a prompt's pages only where each linear's default tiles sum a row
    one way at every bucket (same kernel, same K chunks): true of every preset."""
    from pynanoqwen.kernels.gemm_int4_tiles import rows_sum_alike

    assert rows_sum_alike(PRESETS[preset].engine_linears, PREFILL_BUCKETS)
