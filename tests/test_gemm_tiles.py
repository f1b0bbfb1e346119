"""The prefill GEMM's tile choice (kernels/gemm_int4.default_tiles_for), without a GPU: at every
model size and prefill bucket each linear gets one of the product's tiles, all deterministic
(split-K, whose atomic partial sums would make a prompt's logits differ from run to run and graph
runs from eager ones, is dev/gemm_wgmma_split_k.py's), and one that fits its shape."""

import pytest

from pynanoqwen.config import PRESETS
from pynanoqwen.engine import PREFILL_BUCKETS
from pynanoqwen.kernels.gemm_int4_tiles import TILE_NAMES, default_tiles_for, matrices_of


def layer_shapes(cfg):
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [(qkv, cfg.hidden_size, "bias"), (cfg.hidden_size, cfg.hidden_size, "residual"),
            (cfg.intermediate_size, cfg.hidden_size, "gate_up_silu"),
            (cfg.hidden_size, cfg.intermediate_size, "residual")]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_bucket_gets_a_deterministic_tile_that_fits(preset):
    for n, k, epilogue in layer_shapes(PRESETS[preset]):
        for m in PREFILL_BUCKETS:
            tiles = default_tiles_for(m, n, k, epilogue)
            assert tiles in TILE_NAMES, (preset, n, k, epilogue, m, tiles)
            assert tiles.fits(n, k, matrices_of(epilogue)), (preset, n, k, epilogue, m, TILE_NAMES[tiles])


def test_7b_prompts_beyond_16_tokens_run_on_wgmma():
    from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile

    for n, k, epilogue in layer_shapes(PRESETS["7b"]):
        assert all(isinstance(default_tiles_for(m, n, k, epilogue), WgmmaTile) for m in PREFILL_BUCKETS if m > 16)
