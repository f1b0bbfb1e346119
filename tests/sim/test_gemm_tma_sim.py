"""The wgmma INT4 GEMM fed by TMA boxes, thread 0 producing and mbarrier pairs: the product's
(kernels/gemm_int4_tma.py, through gemm_int4's factories on a TmaTile) and dev/gemm_wgmma_tma.py's
other forms (a producer warp of its own, thread 0 at lag 1, K in chunks with their running total
in registers), under the CUDA simulator, at tiny tiles, on fresh random inputs:

- exact operands (test_gemm_sim.py's: every product and partial sum exact in FP32), so the result
  must equal float64 numpy exactly, but for the epilogue's one rounding: a box copied to the wrong
  stage or without the 128-byte swizzle (the simulated wgmma reads B through it), an up row taken
  from the gate box, a stage refilled before its consumers released it (the simulated copy engine
  lands its bytes later, so a stage read before its `full` phase holds the previous tile), or rows
  past M not zero-filled all change it;
- Gaussian operands: the cp.async kernel (gemm_int4_wgmma.py) on the same tile shape and K chunks
  gives the same bits (the same products summed in the same order), which the prefix cache needs.
"""

import numpy as np
import pytest
from numba import cuda

from gemm_wgmma_tma import TmaGemm
from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_tma import TmaTile
from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile
from pynanoqwen.ptx import SIMULATOR
from test_gemm_sim import EXTRA_ROWS, U16, U32, exact_activations, exact_linear

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

ONE_WARPGROUP = WgmmaTile(warpgroups=1, tokens=64, stages=3)
TWO_WARPGROUPS = WgmmaTile(warpgroups=2, tokens=64, stages=3)  # under the simulator's 48 KiB of shared memory
FOUR_STAGES = WgmmaTile(warpgroups=1, tokens=64, stages=4)  # thread 0 producing at lag 1 needs a fourth
PRODUCT = "product"  # lane_lag of a case run by the product's kernel: thread 0 at lag 0
CASES = [  # (epilogue, m, n, k, tiles, K chunks, lane_lag: None for dev's producer warp)
    ("plain", 70, 64, 256, ONE_WARPGROUP, 1, PRODUCT),  # 2 token blocks, the second mostly past m; the ring wraps
    ("residual", 1, 64, 384, ONE_WARPGROUP, 1, PRODUCT),  # one token, 3 scale groups
    ("bias", 7, 128, 256, ONE_WARPGROUP, 1, PRODUCT),  # 2 column blocks
    ("plain", 150, 128, 256, TWO_WARPGROUPS, 1, PRODUCT),  # 3 token blocks of two warpgroups
    ("gate_up_silu", 33, 64, 256, ONE_WARPGROUP, 1, PRODUCT),  # gate and up boxes, 32 columns a block
    ("gate_up_silu", 20, 128, 256, TWO_WARPGROUPS, 1, PRODUCT),
    ("residual", 9, 64, 512, ONE_WARPGROUP, 2, None),  # dev: the producer warp, K summed in 2 fixed chunks
    ("gate_up_silu", 20, 128, 256, TWO_WARPGROUPS, 1, None),
    ("residual", 9, 64, 512, FOUR_STAGES, 2, 1),  # dev: thread 0 one tile further ahead
    ("gate_up_silu", 33, 64, 256, FOUR_STAGES, 1, 1),
]
CASES += [  # the product's K chunks, their running totals in a workspace (gemm_int4_tma.py, "K chunks")
    ("residual", 70, 64, 512, ONE_WARPGROUP, 2, PRODUCT),  # 2 token blocks: each its own workspace words
    ("plain", 20, 128, 640, TWO_WARPGROUPS, 3, PRODUCT),  # 3 chunks: stored, added to, read back
]
IDS = [f"{e}-m{m}-n{n}-k{k}-wg{t.warpgroups}-s{t.stages}-c{c}-" + ('warp' if lag is None else f'lag{lag}')
       for e, m, n, k, t, c, lag in CASES]


def product_launch(epilogue, n, k, tiles, chunks, weights, x_device, out_device, m, bias):
    """gemm_int4's factories on these tiles: the cp.async kernel on a WgmmaTile, TMA on a TmaTile."""
    if epilogue == "gate_up_silu":
        make_gate_up_silu_gemm(n, k, *weights[0], *weights[1], tiles=tiles).launch(0, x_device, out_device, m)
    else:
        make_gemm_int4(n, k, *weights[0], bias=bias, tiles=tiles, chunks=chunks).launch(
            0, x_device, out_device, m, residual=epilogue == "residual")


def launch_both(epilogue, m, n, k, tiles, chunks, lane_lag, weights, x, out, bias=None):
    """(the TMA kernel's output, the cp.async kernel's) from the same operands, rows up to m."""
    results = []
    for which in ("tma", "cp.async"):
        out_device = cuda.to_device(out)
        x_device = cuda.to_device(x)
        if which == "tma" and lane_lag == PRODUCT:
            product_launch(epilogue, n, k, TmaTile(tiles.warpgroups, tiles.tokens, tiles.stages), chunks, weights,
                           x_device, out_device, m, bias)
        elif which == "tma":
            on_device = [tuple(cuda.to_device(a) for a in w) for w in weights]
            TmaGemm(n, k, on_device, epilogue, tiles, chunks, None if bias is None else cuda.to_device(bias),
                    lane_lag).launch(0, x_device, out_device, m)
        else:
            product_launch(epilogue, n, k, tiles, chunks, weights, x_device, out_device, m, bias)
        result = out_device.copy_to_host()
        assert np.array_equal(result[m:], out[m:], equal_nan=True), f"{which}: rows past m were written"
        results.append(result[:m])
    return results


@pytest.mark.parametrize("epilogue, m, n, k, tiles, chunks, lane_lag", CASES, ids=IDS)
def test_tma_gemm_exact_operands_against_float64(epilogue, m, n, k, tiles, chunks, lane_lag):
    rng = np.random.default_rng()
    linears = [exact_linear(rng, n, k) for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    x = exact_activations(rng, m, k)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out_dtype = np.float16 if epilogue == "gate_up_silu" else np.float32
    out = np.full((m + EXTRA_ROWS, n), np.nan, out_dtype) if epilogue == "gate_up_silu" else \
        rng.standard_normal((m + EXTRA_ROWS, n)).astype(out_dtype)
    y, _ = launch_both(epilogue, m, n, k, tiles, chunks, lane_lag, [(q, s) for q, s, _ in linears], x, out, bias)
    y = y.astype(np.float64)
    products = [x[:m].astype(np.float64) @ w.T for _, _, w in linears]
    if epilogue == "gate_up_silu":
        with np.errstate(over="ignore"):  # exp(-g), g < -88: inf, silu -0
            expected = products[0] / (1 + np.exp(-products[0])) * products[1]
        # As test_gemm_sim.py: the FP16 store of a float32 silu(g) * u within a few u32.
        assert np.all(np.abs(y - expected) <= (U16 + 8 * U32) * np.abs(expected) + 2.0**-25)
        return
    expected = products[0]
    if epilogue == "plain":
        assert np.array_equal(y, expected)
        return
    expected = expected + (bias if epilogue == "bias" else out[:m])
    # One FP32 add (bias or residual) after exact products; with chunks, each chunk's sum and the
    # adds of the chunk sums are exact too (multiples of 2^-10 below 2^12).
    assert np.all(np.abs(y - expected) <= U32 * np.abs(expected))


@pytest.mark.parametrize("epilogue, m, n, k, tiles, chunks, lane_lag", CASES, ids=IDS)
def test_tma_gemm_gives_the_products_bits(epilogue, m, n, k, tiles, chunks, lane_lag):
    rng = np.random.default_rng()
    weights = [(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
                rng.uniform(0.005, 0.5, size=(n, k // 128)).astype(np.float16))
               for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    x = rng.standard_normal((m + EXTRA_ROWS, k)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out = rng.standard_normal((m + EXTRA_ROWS, n)).astype(np.float16 if epilogue == "gate_up_silu" else np.float32)
    tma, product = launch_both(epilogue, m, n, k, tiles, chunks, lane_lag, weights, x, out, bias)
    assert np.array_equal(tma, product, equal_nan=True)
