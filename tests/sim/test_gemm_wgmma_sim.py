"""The wgmma INT4 GEMM (kernels/gemm_int4_wgmma.py) under the CUDA simulator, every epilogue, at
tiny sizes and one-warpgroup tiles of 64 tokens (the GPU kernel's code: dynamic shared ring,
128-byte swizzle, per-lane pair unpack, gate/up row interleave, split-K), against float64 numpy
on fresh random inputs. Operands and tolerances as in test_gemm_sim.py: with "exact" operands the
product must come out exact, leaving only the epilogue's own rounding. The simulated wgmma reads B
through the swizzle from the shared tile, so a copy written to the wrong chunk, a descriptor index
off by a k step or a fragment in the wrong lane gives a wrong product here.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile
from pynanoqwen.ptx import SIMULATOR

from test_gemm_sim import EXTRA_ROWS, U16, U32, exact_activations, exact_linear, run

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

SIM_WGMMA = WgmmaTile(warpgroups=1, tokens=64, stages=3)
SIM_WGMMA_SPLIT_K = WgmmaTile(warpgroups=1, tokens=64, stages=3, splits=2)


@pytest.mark.parametrize("m, n, k, epilogue", [
    (70, 64, 256, "plain"),      # 2 token blocks, the second mostly zero-filled rows; 4 k tiles, 2 groups
    (7, 128, 256, "bias"),       # 2 column blocks
    (1, 64, 384, "residual"),    # one token; 3 scale groups, the 3-stage ring wraps twice
    (17, 64, 128, "float16"),    # a single group: the prologue covers half of K
])
def test_wgmma_gemm_exact_operands(m, n, k, epilogue):
    rng = np.random.default_rng()
    qweight, scales, w = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out_dtype = np.float16 if epilogue == "float16" else np.float32
    out = rng.standard_normal((m + EXTRA_ROWS, n)).astype(out_dtype)
    gemm = make_gemm_int4(n, k, qweight, scales, bias=bias, out_dtype=np.dtype(out_dtype).name, tiles=SIM_WGMMA)
    y = run(gemm, x, out, m, residual=epilogue == "residual")
    expected = x[:m].astype(np.float64) @ w.T
    if epilogue == "plain":
        assert np.array_equal(y, expected)
        return
    if epilogue == "bias":
        expected += bias
    if epilogue == "residual":
        expected += out[:m]
    rounding = U16 if epilogue == "float16" else U32
    assert np.all(np.abs(y - expected) <= rounding * np.abs(expected) + (2.0**-25 if epilogue == "float16" else 0))


def test_wgmma_split_k_residual_exact_operands():
    rng = np.random.default_rng()
    m, n, k = 9, 64, 256  # one scale group per split
    qweight, scales, w = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    out = rng.standard_normal((m + EXTRA_ROWS, n)).astype(np.float32)
    gemm = make_gemm_int4(n, k, qweight, scales, tiles=SIM_WGMMA_SPLIT_K)
    y = run(gemm, x, out, m, residual=True)
    x64 = x[:m].astype(np.float64)
    running = np.abs(out[:m]) + np.abs(x64) @ np.abs(w.T)
    assert np.all(np.abs(y - (out[:m] + x64 @ w.T)) <= 2 * U32 * running)
    with pytest.raises(ValueError, match="residual epilogue only"):
        gemm.launch(0, cuda.to_device(x), cuda.to_device(out), m)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp(-g), g < -88: inf, silu -0
def test_wgmma_gate_up_silu_exact_operands():
    rng = np.random.default_rng()
    m, n, k = 33, 64, 256  # a block holds 32 columns of each matrix: 2 column blocks
    gate_q, gate_s, wg = exact_linear(rng, n, k)
    up_q, up_s, wu = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    mlp = make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, tiles=SIM_WGMMA)
    y = run(mlp, x, np.full((m + EXTRA_ROWS, n), np.nan, np.float16), m)
    g, u = x[:m].astype(np.float64) @ wg.T, x[:m].astype(np.float64) @ wu.T
    expected = g / (1 + np.exp(-g)) * u
    assert np.all(np.abs(y - expected) <= (U16 + 8 * U32) * np.abs(expected) + 2.0**-25)


def test_wgmma_gaussian_activations_within_accumulation_bound():
    rng = np.random.default_rng()
    m, n, k = 20, 64, 256
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.005, 0.5, size=(n, k // 128)).astype(np.float16)
    from pynanoqwen.quant import dequantize_int4
    w = dequantize_int4(qweight, scales, np.float64)
    x = rng.standard_normal((m + EXTRA_ROWS, k)).astype(np.float16)
    gemm = make_gemm_int4(n, k, qweight, scales, tiles=SIM_WGMMA)
    y = run(gemm, x, np.zeros((m + EXTRA_ROWS, n), np.float32), m)
    x64 = x[:m].astype(np.float64)
    magnitude = np.abs(x64) @ np.abs(w.T)
    assert np.all(np.abs(y - x64 @ w.T) <= (U16 + 37 * (k // 16 + 1) * U32) * magnitude)
