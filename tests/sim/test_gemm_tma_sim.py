"""dev/gemm_wgmma_tma.py (the wgmma INT4 GEMM fed by TMA boxes, a producer lane and mbarrier
pairs) under the CUDA simulator, at tiny tiles, on fresh random inputs:

- exact operands (test_gemm_sim.py's: every product and partial sum exact in FP32), so the result
  must equal float64 numpy exactly, but for the epilogue's one rounding: a box copied to the wrong
  stage or without the 128-byte swizzle (the simulated wgmma reads B through it), an up row taken
  from the gate box, a stage refilled before its consumers released it (the simulated copy engine
  lands its bytes later, so a stage read before its `full` phase holds the previous tile), or rows
  past M not zero-filled all change it;
- Gaussian operands: the product's kernel on the same tile and K chunks gives the same bits
  (the same products summed in the same order).
Both producers: a warp of its own, and thread 0 refilling between its own k tiles (lag 0 and 1).
"""

import numpy as np
import pytest
from numba import cuda

from gemm_wgmma_tma import TmaGemm
from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile
from pynanoqwen.ptx import SIMULATOR
from test_gemm_sim import EXTRA_ROWS, U16, U32, exact_activations, exact_linear

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

ONE_WARPGROUP = WgmmaTile(warpgroups=1, tokens=64, stages=3)
TWO_WARPGROUPS = WgmmaTile(warpgroups=2, tokens=64, stages=3)  # under the simulator's 48 KiB of shared memory
FOUR_STAGES = WgmmaTile(warpgroups=1, tokens=64, stages=4)  # thread 0 producing at lag 1 needs a fourth
CASES = [  # (epilogue, m, n, k, tiles, K chunks, lane_lag: None for the producer warp)
    ("plain", 70, 64, 256, ONE_WARPGROUP, 1, None),  # 2 token blocks, the second mostly rows past m; the ring wraps
    ("residual", 1, 64, 384, ONE_WARPGROUP, 1, None),  # one token, 3 scale groups
    ("bias", 7, 128, 256, ONE_WARPGROUP, 1, None),  # 2 column blocks
    ("residual", 9, 64, 512, ONE_WARPGROUP, 2, None),  # K summed in 2 fixed chunks
    ("plain", 150, 128, 256, TWO_WARPGROUPS, 1, None),  # 3 token blocks of two warpgroups
    ("gate_up_silu", 33, 64, 256, ONE_WARPGROUP, 1, None),  # gate and up boxes, 32 columns a block
    ("gate_up_silu", 20, 128, 256, TWO_WARPGROUPS, 1, None),
    ("bias", 7, 128, 256, ONE_WARPGROUP, 1, 0),  # thread 0 producing, one tile in flight ahead
    ("residual", 9, 64, 512, FOUR_STAGES, 2, 1),
    ("plain", 150, 128, 256, TWO_WARPGROUPS, 1, 0),
    ("gate_up_silu", 33, 64, 256, FOUR_STAGES, 1, 1),
]
IDS = [f"{e}-m{m}-n{n}-k{k}-wg{t.warpgroups}-s{t.stages}-c{c}-{'warp' if lag is None else f'lag{lag}'}"
       for e, m, n, k, t, c, lag in CASES]


def launch_both(epilogue, m, n, k, tiles, chunks, lane_lag, weights, x, out, bias=None):
    """(this kernel's output, the product's) from the same operands, rows up to m."""
    results = []
    for which in ("tma", "product"):
        out_device = cuda.to_device(out)
        x_device = cuda.to_device(x)
        if which == "tma":
            on_device = [tuple(cuda.to_device(a) for a in w) for w in weights]
            TmaGemm(n, k, on_device, epilogue, tiles, chunks, None if bias is None else cuda.to_device(bias),
                    lane_lag).launch(0, x_device, out_device, m)
        elif epilogue == "gate_up_silu":
            make_gate_up_silu_gemm(n, k, *weights[0], *weights[1], tiles=tiles).launch(0, x_device, out_device, m)
        else:
            make_gemm_int4(n, k, *weights[0], bias=bias, tiles=tiles, chunks=chunks).launch(
                0, x_device, out_device, m, residual=epilogue == "residual")
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


@pytest.mark.parametrize("epilogue", ["residual", "gate_up_silu"])
def test_prefill_tma_linear_wraps_the_engines_gemm(epilogue):
    """dev/prefill_tma.py's TmaLinear, over the engine's own GEMM object (its flat weights and scale
    bits), gives that object's bits on the same tile at and above its row threshold, and below it
    is that object."""
    from prefill_tma import TmaLinear

    rng = np.random.default_rng()
    n, k, threshold = 64, 256, 8
    weights = [(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
                rng.uniform(0.005, 0.5, size=(n, k // 128)).astype(np.float16))
               for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    if epilogue == "gate_up_silu":
        product = make_gate_up_silu_gemm(n, k, *weights[0], *weights[1], tiles=ONE_WARPGROUP)
    else:
        product = make_gemm_int4(n, k, *weights[0], tiles=ONE_WARPGROUP)
    wrapped = TmaLinear(product, n, k, epilogue, threshold, tiles=ONE_WARPGROUP)
    for m in (threshold - 1, threshold + 9):
        x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16))
        start = rng.standard_normal((m, n)).astype(np.float16 if epilogue == "gate_up_silu" else np.float32)
        outs = []
        for linear in (product, wrapped):
            out = cuda.to_device(start)
            if epilogue == "residual":
                linear.launch(0, x, out, m, residual=True)
            else:
                linear.launch(0, x, out, m)
            outs.append(out.copy_to_host())
        assert np.array_equal(outs[0], outs[1], equal_nan=True), m
