"""INT4 tensor-core GEMM on the GPU: every 7B linear (with the epilogue prefill uses there) at
M in {1, 7, 64, 512, 2048} against float64 numpy on fresh random weights and activations, and
every tile shape bench's GEMM table compares at M = 512; the table itself
(bench_kernels.gemm_tiles) runs once at small shapes. And a row's result is the same bits whichever
wgmma tile computes it, at whatever M: the engine's prefix cache relies on it (docs/DECODE.md,
"Prefix cache").

Error bound, derived (u16 = 2^-11, u32 = 2^-24; mag = |X| |W|^T, W the exact dequantized weights):
- the kernel rounds each weight (u - 8) s to FP16 once: u16 mag (scales here are far above the
  FP16 subnormal range, so the rounding is relative);
- each mma adds 16 exact FP16 products to the FP32 accumulator c. Model of the tensor core (Fasi,
  Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): the 17
  addends are aligned to the largest and truncated to >= 24 significant bits, then the sum is
  normalised to FP32; the step's error is at most 17 x 2^-23 max + 2^-23 |sum| <= 36 u32 (|c| +
  sum |p|). Over the K/16 steps, with every |c| <= mag (1 + u16)(1 + 0.3%) (the sums' own growth),
  the accumulated error is at most 37 (K/16 + 1) u32 mag;
- the wgmma kernel sums K in up to K_CHUNKS chunks (gemm_int4_tiles.k_chunks) and adds the chunk
  sums in float32: K_CHUNKS - 1 more roundings, each at most u32 of a partial sum <= mag (1 + 0.3%):
  K_CHUNKS u32 mag, counted for every tile (a tile that sums K in one chunk meets it with room);
- epilogues: one FP32 rounding of the bias or residual add (u32 |result|), the FP16 store
  (u16 |result|, or 2^-25 absolute below the normal range), silu in float32 (a few u32);
The bound is a worst case (~5e-4 mag at K = 3584); a fragment or layout mistake is O(mag).
"""

import numpy as np
import pytest

from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_tiles import K_CHUNKS, SMALL, TILE_NAMES, candidate_tiles
from pynanoqwen.quant import dequantize_int4

pytestmark = pytest.mark.gpu

U16, U32 = 2.0**-11, 2.0**-24
HIDDEN, INTERMEDIATE, QKV = 3584, 18944, 4608
PEAK = 790e12  # FLOP/s: dense bf16 matrix product through PyTorch on the H200 (bench_kernels.PEAK_TFLOPS)
SHAPES = [("qkv", QKV, HIDDEN, "bias"), ("o_proj", HIDDEN, HIDDEN, "residual"),
          ("gate_up", INTERMEDIATE, HIDDEN, "gate_up_silu"), ("down_proj", HIDDEN, INTERMEDIATE, "residual")]


def variants(n, k, epilogue):
    """The tile shapes bench's GEMM table compares for this linear, but SMALL (M <= 16 only)."""
    return [tiles for tiles in candidate_tiles(n, k, epilogue) if tiles is not SMALL]


def random_int4(rng, n, k):
    """Random packed words (all 16 nibble values) and signed FP16 scales of a typical size."""
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.005, 0.02, size=(n, k // 128)) * rng.choice([-1, 1], size=(n, k // 128))
    return qweight, scales.astype(np.float16)


def reference(qweight, scales, x64):
    """(X W^T, |X| |W|^T) in float64."""
    w = dequantize_int4(qweight, scales, np.float64)
    return x64 @ w.T, np.abs(x64) @ np.abs(w.T)


def accumulation_bound(magnitude, k):
    return (U16 + (37 * (k // 16 + 1) + K_CHUNKS) * U32) * magnitude


def run_gemm(gemm, x, out, m, **epilogue):
    from numba import cuda

    stream = cuda.stream()
    out_device = cuda.to_device(out, stream=stream)
    gemm.launch(stream, cuda.to_device(x, stream=stream), out_device, m, **epilogue)
    result = out_device.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.array_equal(result[m:], out[m:], equal_nan=True), "rows past m were written"
    return result[:m].astype(np.float64)


def check_against_float64(name, n, k, epilogue, m, tile_shapes):
    """Run the shape's GEMM with each tile shape (None: the default for m) on one fresh random
    problem and check every result against the float64 reference within the derived bound."""
    rng = np.random.default_rng()
    x = rng.standard_normal((m + 5, k)).astype(np.float16)  # rows past m: never read into the result
    x64 = x[:m].astype(np.float64)
    if epilogue == "gate_up_silu":
        (gate_q, gate_s), (up_q, up_s) = random_int4(rng, n, k), random_int4(rng, n, k)
        g, g_magnitude = reference(gate_q, gate_s, x64)
        u, u_magnitude = reference(up_q, up_s, x64)
        bound_g, bound_u = accumulation_bound(g_magnitude, k), accumulation_bound(u_magnitude, k)
        silu = g / (1 + np.exp(-g))
        expected = silu * u
        # FP16 store and float32 silu/product, plus g's and u's errors carried through silu
        # (slope <= 1.1) and the product.
        bound = (U16 + 8 * U32) * np.abs(expected) + 2.0**-25 + 1.1 * np.abs(u) * bound_g \
            + (np.abs(silu) + 1.1 * bound_g) * bound_u
        runs = [(make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, tiles=tiles), tiles,
                 np.full((m + 5, n), np.nan, np.float16), {}) for tiles in tile_shapes]
    else:
        qweight, scales = random_int4(rng, n, k)
        bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
        out = rng.standard_normal((m + 5, n)).astype(np.float32)  # residual adds to fresh values
        expected, magnitude = reference(qweight, scales, x64)
        expected += bias if epilogue == "bias" else out[:m]
        bound = accumulation_bound(magnitude, k) + U32 * np.abs(expected)
        runs = [(make_gemm_int4(n, k, qweight, scales, bias=bias, tiles=tiles), tiles, out,
                 {"residual": epilogue == "residual"}) for tiles in tile_shapes]
    for gemm, tiles, out, epilogue_args in runs:
        y = run_gemm(gemm, x, out, m, **epilogue_args)
        error = np.abs(y - expected)
        worst = np.unravel_index(np.argmax(error / bound), error.shape)
        label = TILE_NAMES[tiles] if tiles else "default"
        assert np.all(error <= bound), (name, m, label, worst, y[worst], expected[worst], bound[worst])


@pytest.mark.parametrize("m", [1, 7, 64, 512, 2048])
@pytest.mark.parametrize("name, n, k, epilogue", SHAPES, ids=[s[0] for s in SHAPES])
def test_gemm_7b_shapes(name, n, k, epilogue, m):
    check_against_float64(name, n, k, epilogue, m, [None])


@pytest.mark.parametrize("name, n, k, epilogue", SHAPES, ids=[s[0] for s in SHAPES])
def test_gemm_tile_variants(name, n, k, epilogue):
    """Every tile shape bench's GEMM table times computes the same function (M = 512)."""
    check_against_float64(name, n, k, epilogue, 512, variants(n, k, epilogue))


@pytest.mark.parametrize("name, n, k, epilogue", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_row_is_the_same_bits_on_every_wgmma_tile_and_m(name, n, k, epilogue):
    """The first 17 rows of one random problem through every wgmma tile that sums K in the
    default tiles' chunks (gemm_int4_tiles.k_chunks) at M = 512, and through the default tiles
    at M = 17, 200 and 2048 (and row 0 at M = 1, rows 0-15 at M = 16): identical bits.
    mma.sync's SMALL, which no 7B chunk runs on any more, is not required to agree and is printed
    for the record."""
    from pynanoqwen.kernels.gemm_int4_tiles import default_tiles_for, k_chunks

    rng = np.random.default_rng()
    rows = 17
    x = rng.standard_normal((2048, k)).astype(np.float16)
    if epilogue == "gate_up_silu":
        (gate_q, gate_s), (up_q, up_s) = random_int4(rng, n, k), random_int4(rng, n, k)
        build = lambda tiles: make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, tiles=tiles)  # noqa: E731
        start, args = np.zeros((2048, n), np.float16), {}
    else:
        qweight, scales = random_int4(rng, n, k)
        bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
        build = lambda tiles: make_gemm_int4(n, k, qweight, scales, bias=bias, tiles=tiles)  # noqa: E731
        start, args = rng.standard_normal((2048, n)).astype(np.float32), {"residual": epilogue == "residual"}
    chunks = k_chunks(k, default_tiles_for(2048, n, k, epilogue), epilogue)
    runs = {TILE_NAMES[tiles]: run_gemm(build(tiles), x, start.copy(), 512, **args)[:rows]
            for tiles in variants(n, k, epilogue) if k_chunks(k, tiles, epilogue) == chunks}
    runs.update({f"default at M = {m}": run_gemm(build(None), x, start.copy(), m, **args)[:rows]
                 for m in (rows, 200, 2048)})
    few = {m: run_gemm(build(None), x, start.copy(), m, **args) for m in (1, 16)}
    small = run_gemm(build(SMALL), x, start.copy(), 16, **args)
    first_name, first = next(iter(runs.items()))
    print(f"\n{name}: SMALL's 16 rows equal {first_name}'s: {np.array_equal(small, first[:16])}")
    for label, result in runs.items():
        assert np.array_equal(result, first), (name, label, first_name)
    for m, result in few.items():
        assert np.array_equal(result, first[:m]), (name, f"default at M = {m}", first_name)


def test_bench_gemm_table_times_every_tile():
    """bench_kernels.gemm_tiles (the TFLOP/s table of `bench`) at 0.5B shapes: every tile that fits
    each shape is timed once, the engine's default is marked, and no figure beats the tensor cores."""
    from pynanoqwen.bench_kernels import gemm_tiles
    from pynanoqwen.config import PRESETS

    rows = gemm_tiles(PRESETS["0.5b"], ms=(128,))
    for name in ("qkv", "o_proj", "gate_up", "down_proj"):
        mine = [r for r in rows if r["name"] == name]
        assert sum(r["default"] for r in mine) == 1 and len({r["tile"] for r in mine}) == len(mine) > 1
    assert all(0 < r["tflops"] < PEAK / 1e12 for r in rows)
