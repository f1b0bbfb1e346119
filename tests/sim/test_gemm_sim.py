"""The INT4 tensor-core GEMMs under the CUDA simulator, every epilogue, at tiny sizes, against
float64 numpy (quant.dequantize_int4) on fresh random inputs; and the warp-cooperative twins of
mma.sync and ldmatrix inside a simulated warp. Each test runs both kernels, through the same
factories the engine uses: the mma.sync kernel (kernels/gemm_int4.py) at a tiny tile (32 x 32, two
warps, three stages) and the wgmma kernel (kernels/gemm_int4_wgmma.py) at one warpgroup and 64
tokens (dynamic shared ring, 128-byte swizzle, per-lane pair unpack, gate/up row interleave; its
simulated wgmma reads B through the swizzle from the shared tile, so a copy written to the wrong
chunk, a descriptor index off by a k step or a fragment in the wrong lane gives a wrong product).

Tolerances, derived rather than tuned (u16 = 2^-11, u32 = 2^-24 unit roundoffs):
- "exact" operands: scales j/128 (|j| < 128) times codes -8..7 are multiples of 1/128 below 8 in
  magnitude, exact in FP16 (10 significant bits); activations m/8 with |m| <= 8. Every product is
  then a multiple of 2^-10 below 8, every partial sum over K <= 384 a multiple of 2^-10 below
  2^12: exact in FP32 (22 bits). So the product must come out exact, and only the epilogue's own
  roundings remain (one FP32 add for bias and residual, the FP16 store, silu in float32). This
  catches any fragment, layout, unpack or pipeline mistake.
- Gaussian activations and arbitrary scales: the bound derived in tests/test_gemm_gpu.py (weights
  rounded to FP16: u16 sum|x w|; FP32 accumulation under its tensor-core model: 37 (K/16 + 1) u32
  sum|x w|). The simulated mma rounds once per step, well inside that.
"""

import numpy as np
import pytest
from numba import cuda, float32, uint32

from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_tiles import TileShape
from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.ptx.mma import ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16
from pynanoqwen.quant import dequantize_int4
from wgmma_probe import check_one_wgmma

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

U16, U32 = 2.0**-11, 2.0**-24
SIM_TILES = TileShape(block_m=32, block_n=32, warps_m=2, warps_n=1, stages=3)
SIM_WGMMA = WgmmaTile(warpgroups=1, tokens=64, stages=3)
BOTH_KERNELS = pytest.mark.parametrize("tiles", [SIM_TILES, SIM_WGMMA], ids=["mma_sync", "wgmma"])
EXTRA_ROWS = 3  # x and out have rows past m: the kernel must neither need nor touch them


def exact_linear(rng, n, k):
    """Random packed words (every nibble value) and scales j/128: W' = (u - 8) s exact in FP16."""
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = (rng.integers(1, 128, size=(n, k // 128)) * rng.choice([-1, 1], size=(n, k // 128)) / 128)
    scales = scales.astype(np.float16)
    return qweight, scales, dequantize_int4(qweight, scales, np.float64)


def exact_activations(rng, m, k):
    return (rng.integers(-8, 9, size=(m + EXTRA_ROWS, k)) / 8).astype(np.float16)


def run(gemm, x, out, m, **epilogue):
    out_device = cuda.to_device(out)
    gemm.launch(0, cuda.to_device(x), out_device, m, **epilogue)
    result = out_device.copy_to_host()
    assert np.array_equal(result[m:], out[m:], equal_nan=True), "rows past m were written"
    return result[:m].astype(np.float64)


@BOTH_KERNELS
@pytest.mark.parametrize("m, n, k, epilogue", [
    (70, 64, 256, "plain"),      # 2 or 3 token blocks, the last mostly zero-filled rows; 2 groups
    (7, 128, 256, "bias"),       # 2 or 4 column blocks
    (1, 64, 384, "residual"),    # one token; 3 scale groups, the stage ring wraps
    (17, 64, 128, "float16"),    # a single group: the pipeline's prologue covers most of K
])
def test_gemm_exact_operands(tiles, m, n, k, epilogue):
    rng = np.random.default_rng()
    qweight, scales, w = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out_dtype = np.float16 if epilogue == "float16" else np.float32
    out = rng.standard_normal((m + EXTRA_ROWS, n)).astype(out_dtype)  # residual adds to fresh values
    gemm = make_gemm_int4(n, k, qweight, scales, bias=bias, out_dtype=np.dtype(out_dtype).name, tiles=tiles)
    y = run(gemm, x, out, m, residual=epilogue == "residual")
    expected = x[:m].astype(np.float64) @ w.T
    if epilogue == "plain":
        assert np.array_equal(y, expected)
        return
    if epilogue == "bias":
        expected += bias
    if epilogue == "residual":
        expected += out[:m]
    rounding = U16 if epilogue == "float16" else U32  # the one rounding left: FP32 add or FP16 store
    assert np.all(np.abs(y - expected) <= rounding * np.abs(expected) + (2.0**-25 if epilogue == "float16" else 0))


@pytest.mark.parametrize("epilogue", ["plain", "gate_up_silu"])
def test_two_warpgroups_copy_every_row_once(epilogue):
    """The stage copies at two warpgroups (256 threads: 2 X copies a thread 32 token rows apart, and
    gate/up weight rows interleaved a warp; 64 tokens keep the ring under the 48 KiB the simulator
    allows): exact products, so a row copied twice, to the wrong swizzle, or from the wrong matrix
    shows. m = 150: the third token block is mostly rows past m."""
    rng = np.random.default_rng()
    m, n, k = 150, 128, 256
    tiles = WgmmaTile(warpgroups=2, tokens=64, stages=3)
    x = exact_activations(rng, m, k)
    gate_q, gate_s, wg = exact_linear(rng, n, k)
    if epilogue == "plain":
        y = run(make_gemm_int4(n, k, gate_q, gate_s, tiles=tiles), x, np.zeros((m + EXTRA_ROWS, n), np.float32), m)
        assert np.array_equal(y, x[:m].astype(np.float64) @ wg.T)
        return
    up_q, up_s, wu = exact_linear(rng, n, k)
    mlp = make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, tiles=tiles)
    y = run(mlp, x, np.full((m + EXTRA_ROWS, n), np.nan, np.float16), m)
    g, u = x[:m].astype(np.float64) @ wg.T, x[:m].astype(np.float64) @ wu.T
    with np.errstate(over="ignore"):  # exp(-g), g < -88: inf, silu -0
        expected = g / (1 + np.exp(-g)) * u
    assert np.all(np.abs(y - expected) <= (U16 + 8 * U32) * np.abs(expected) + 2.0**-25)  # as the test below


def test_split_k_residual_exact_operands():
    """dev/gemm_wgmma_split_k.py: two blocks along K each add their partial product (exact here) to
    out with an atomic add: two FP32 roundings, each at most u32 times a running sum bounded by
    |out| + |X| |W|^T."""
    from gemm_wgmma_split_k import SplitKGemm, SplitKTile

    rng = np.random.default_rng()
    m, n, k = 9, 64, 256  # one scale group per split
    qweight, scales, w = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    out = rng.standard_normal((m + EXTRA_ROWS, n)).astype(np.float32)
    gemm = SplitKGemm(n, k, SplitKTile(warpgroups=1, tokens=64, stages=3, splits=2), cuda.to_device(qweight),
                      cuda.to_device(scales))
    out_device = cuda.to_device(out)
    gemm.launch(0, cuda.to_device(x[:m]), out_device)
    y = out_device.copy_to_host()
    assert np.array_equal(y[m:], out[m:]), "rows past m were written"
    x64 = x[:m].astype(np.float64)
    expected = out[:m] + x64 @ w.T
    running = np.abs(out[:m]) + np.abs(x64) @ np.abs(w.T)
    assert np.all(np.abs(y[:m] - expected) <= 2 * U32 * running)


@BOTH_KERNELS
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp(-g), g < -88: inf, silu -0
def test_gate_up_silu_exact_operands(tiles):
    rng = np.random.default_rng()
    m, n, k = 33, 64, 256  # a block holds 16 (mma.sync) or 32 (wgmma) columns of each matrix
    gate_q, gate_s, wg = exact_linear(rng, n, k)
    up_q, up_s, wu = exact_linear(rng, n, k)
    x = exact_activations(rng, m, k)
    mlp = make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, tiles=tiles)
    y = run(mlp, x, np.full((m + EXTRA_ROWS, n), np.nan, np.float16), m)
    g, u = x[:m].astype(np.float64) @ wg.T, x[:m].astype(np.float64) @ wu.T  # exact in the kernel too
    expected = g / (1 + np.exp(-g)) * u
    # FP16 store (relative u16, or 2^-25 absolute among subnormals) of a float32 silu(g) * u that
    # is within a few u32 (exp, add, divide, multiply).
    assert np.all(np.abs(y - expected) <= (U16 + 8 * U32) * np.abs(expected) + 2.0**-25)


@BOTH_KERNELS
def test_gemm_gaussian_activations_within_accumulation_bound(tiles):
    rng = np.random.default_rng()
    m, n, k = 20, 64, 256
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.005, 0.5, size=(n, k // 128)).astype(np.float16)
    w = dequantize_int4(qweight, scales, np.float64)
    x = rng.standard_normal((m + EXTRA_ROWS, k)).astype(np.float16)
    gemm = make_gemm_int4(n, k, qweight, scales, tiles=tiles)
    y = run(gemm, x, np.zeros((m + EXTRA_ROWS, n), np.float32), m)
    x64 = x[:m].astype(np.float64)
    magnitude = np.abs(x64) @ np.abs(w.T)
    assert np.all(np.abs(y - x64 @ w.T) <= (U16 + 37 * (k // 16 + 1) * U32) * magnitude)


def gaussian_linear(rng, n, k):
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = (rng.uniform(0.005, 0.5, size=(n, k // 128)) * rng.choice([-1, 1], size=(n, k // 128))).astype(np.float16)
    return qweight, scales, dequantize_int4(qweight, scales, np.float64)


@pytest.mark.parametrize("k, epilogue", [(512, "residual"), (640, "bias")])  # 4 groups, 1 a chunk; 5 in 4 chunks
def test_k_chunks_split_form_has_the_sequential_forms_bits(k, epilogue):
    """The wgmma kernel summing K in 4 chunks (gemm_int4_wgmma.py, "K chunks"). Its split form
    (one block a chunk, the tile's last block folds the chunk sums) must give the bits of its
    sequential form (one block, all chunks): Gaussian operands, where another order of the float32
    adds shows in the last bits (the simulated wgmma rounds at every k step). The rows of a 9-row
    launch (split: one token tile, one column tile, below the simulator's 2 SMs) must also be the
    first 9 rows of a 70-row launch (sequential: two token tiles), as the prefix cache needs. A
    second split launch checks that the last block reset its counter. And against float64 within
    the accumulation bound plus the chunks' adds (3 more float32 roundings, each at most u32 of the
    magnitude)."""
    from pynanoqwen.kernels.gemm_int4 import SplitWorkspace

    rng = np.random.default_rng()
    n, tiles, chunks = 64, SIM_WGMMA, 4
    qweight, scales, w = gaussian_linear(rng, n, k)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    x = rng.standard_normal((70 + EXTRA_ROWS, k)).astype(np.float16)
    out = rng.standard_normal((70 + EXTRA_ROWS, n)).astype(np.float32)
    gemm = make_gemm_int4(n, k, qweight, scales, bias=bias, tiles=tiles, chunks=chunks)
    assert gemm.kernel(9, epilogue == "residual")[2] == chunks
    residual = epilogue == "residual"
    workspace = SplitWorkspace(64, n, chunks)
    split = [run_with(gemm, x, out, 9, residual, workspace) for _ in range(2)]
    sequential = run_with(gemm, x, out, 9, residual, None)
    longer = run_with(gemm, x, out, 70, residual, workspace)  # two token tiles: 2 blocks, sequential
    assert np.array_equal(split[0], sequential) and np.array_equal(split[1], sequential)
    assert np.array_equal(longer[:9], sequential)
    x64 = x[:70].astype(np.float64)
    expected = x64 @ w.T + (out[:70] if residual else bias.astype(np.float64))
    magnitude = np.abs(x64) @ np.abs(w.T)
    bound = (U16 + (37 * (k // 16 + 1) + chunks) * U32) * magnitude + U32 * np.abs(expected)
    assert np.all(np.abs(longer - expected) <= bound)


def run_with(gemm, x, out, m, residual, workspace):
    out_device = cuda.to_device(out)
    gemm.launch(0, cuda.to_device(x), out_device, m, residual=residual, workspace=workspace)
    result = out_device.copy_to_host()
    assert np.array_equal(result[m:], out[m:]), "rows past m were written"
    return result[:m]


def test_shapes_that_do_not_tile_are_refused():
    rng = np.random.default_rng()
    qweight, scales, _ = exact_linear(rng, 48, 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        make_gemm_int4(48, 256, qweight, scales, tiles=SIM_TILES)


@cuda.jit
def product_through_fragments(a, b, d):
    """D (16x16) = A (16x16) B (16x16), one warp: A by ldmatrix, B (row-major k x n) by
    ldmatrix.trans, two mma n8 tiles."""
    a_tile = cuda.shared.array(128, uint32)
    b_tile = cuda.shared.array(128, uint32)
    lane = cuda.threadIdx.x
    for i in range(4):
        a_tile[32 * i + lane] = a[32 * i + lane]
        b_tile[32 * i + lane] = b[32 * i + lane]
    cuda.syncthreads()
    matrix, r = lane // 8, lane % 8
    # Matrix i covers rows 8 (i % 2).. and columns 8 (i // 2)..; a row of 16 halves is 8 words.
    row, col = 8 * (matrix % 2) + r, 8 * (matrix // 2)
    a0, a1, a2, a3 = ldmatrix_x4(a_tile, row * 8 + col // 2)
    b0, b1, b2, b3 = ldmatrix_x4_trans(b_tile, row * 8 + col // 2)
    zero = float32(0)
    g, t = lane // 4, lane % 4
    for tile, (lo, hi) in enumerate(((b0, b1), (b2, b3))):
        d0, d1, d2, d3 = mma_m16n8k16(a0, a1, a2, a3, lo, hi, zero, zero, zero, zero)
        col = 8 * tile + 2 * t
        d[g, col], d[g, col + 1], d[g + 8, col], d[g + 8, col + 1] = d0, d1, d2, d3


def test_mma_and_ldmatrix_twins_in_a_simulated_warp():
    rng = np.random.default_rng()
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    d = np.zeros((16, 16), np.float32)
    product_through_fragments[1, 32](a.view(np.uint32).ravel(), b.view(np.uint32).ravel(), d)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert np.array_equal(d, expected)


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("step", [0, 3])
@pytest.mark.parametrize("mn_major", [False, True])
def test_wgmma_twin_in_a_simulated_warpgroup(n, step, mn_major):
    """The same one-wgmma check tests/test_ptx_wgmma_gpu.py runs on the GPU (wgmma_probe.py)."""
    check_one_wgmma(n, step, mn_major)
