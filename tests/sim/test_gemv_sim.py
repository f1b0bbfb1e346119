"""Both INT4 GEMV paths, every epilogue and the fused gate/up, under the CUDA simulator at tiny
sizes, against float64 numpy (quant.dequantize_int4) on fresh random inputs.

Tolerances, derived rather than tuned (u16 = 2^-11, u32 = 2^-24 unit roundoffs):
- "exact" activations x = m/8 with |m| <= 8: every product w*x is a multiple of 1/8 of magnitude
  <= 7 and one lane's FP16 accumulator sums 16 of them per half, so it stays below 112 with 1/8
  resolution: exact in FP16 (11 bits). Only float32 rounding remains: per chunk three roundings
  (halves summed, scale, accumulate) over a lane's at most S = ceil(K/1024) chunks, 5 warp_sum
  steps, the partials of the at most S warps sharing a tile, bias: at most 4 S + 6 <= K/32 + 8
  roundings, each <= u32 * sum |s w x|. This is the test that catches any layout or unpack mistake.
- Gaussian FP16 activations on the prmt path: each of the 16 FP16 FMAs of a half-accumulator
  rounds by at most u16 of a partial sum <= the sum of |s w x| it covers, so |error| <=
  16 u16 * sum |s w x| (plus the float32 term above).
- dp4a: the integer dot is exact, so against the quantized activations the float32 bound holds; against
  x itself each input adds |s w| * (x_scale/2 + 2^-22 |x|) (quantize_activation.py's rounding).
- fixed16: the same with 16-bit integers per chunk of 32 inputs (x_scale = max|x| / 32767): against
  the numpy model of its staging (fixed16_activations) the float32 bound holds; against x itself
  oracles.gemv_oracle's bound.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.kernels.gemv_int4 import GemvPlan, make_gate_up_silu, make_gemv_int4
from pynanoqwen.oracles import activation_scales, gemv_oracle
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.quant import dequantize_int4, quantize_int4

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

U16, U32 = 2.0**-11, 2.0**-24


def random_linear(rng, n, k):
    qweight, scales = quantize_int4(rng.standard_normal((n, k)).astype(np.float32))
    return qweight, scales, dequantize_int4(qweight, scales, np.float64)


def exact_activations(rng, k):
    return (rng.integers(-8, 9, size=k) / 8).astype(np.float16)


def float32_bound(w, x, k):
    return (k // 32 + 8) * U32 * (np.abs(w) @ np.abs(x.astype(np.float64)))


def run(gemv, x, out, **epilogue):
    out_device = cuda.to_device(out)
    gemv.launch(0, cuda.to_device(x), out_device, **epilogue)
    return out_device.copy_to_host()


def dequantized_activations(gemv, k):
    """x as the dp4a GEMV saw it: its INT8 workspace decoded back to input order, times the scale."""
    int8 = gemv._input.int8
    chunks = k // 32
    words = int8.xq.copy_to_host().reshape(8, chunks)  # word j of chunk c at [j, c]
    q = words.T.copy().view(np.int8).reshape(chunks, 4, 2, 4)  # chunk, octet, A/B, byte
    octets = np.empty((chunks, 4, 8), np.int64)
    octets[:, :, [0, 1, 4, 5]] = q[:, :, 0]
    octets[:, :, [2, 3, 6, 7]] = q[:, :, 1]
    q = octets.reshape(k)
    scale = int8.scale.copy_to_host()
    offsets = int8.offset.copy_to_host()
    assert np.array_equal(offsets, 8 * q.reshape(chunks, 32).sum(axis=1))
    return q * np.repeat(scale.astype(np.float64), 128), scale


def fixed16_activations(x):
    """x as the fixed16 GEMV stages it (kernels/gemv_int4_paths.py), in numpy: per chunk of 32
    inputs, v = x * float32(32767 / max|x|) rounded once to an integer (the float64 product of two
    float32 is exact), read back as v * oracles.activation_scales (max|x| * float32(1 / 32767))."""
    chunks = np.asarray(x, np.float32).reshape(-1, 32)
    largest = np.abs(chunks).max(axis=1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(32767) / np.where(largest > 0, largest, np.float32(1)), np.float32(0))
    ints = np.rint(chunks.astype(np.float64) * inverse.astype(np.float64))
    assert np.all(np.abs(ints) <= 32767)
    return (ints * activation_scales("fixed16", largest).astype(np.float64)).reshape(-1)


def activations_used(gemv, k, path, x):
    """The activations the GEMV multiplies, in float64: x itself (prmt), its INT8 workspace decoded
    (dp4a), or its 16-bit chunks (fixed16, modelled in numpy)."""
    if path == "dp4a":
        return dequantized_activations(gemv, k)[0]
    return fixed16_activations(x) if path == "fixed16" else np.asarray(x, np.float64)


# The simulator reports 2 SMs (device.SIMULATED_SM_COUNT), so a plan of 2 warps and 1 block per SM
# runs 4 warps: each walks several tiles, and its pipeline of `depth` loads crosses tile boundaries.
PIPELINED = GemvPlan(rows=1, depth=4, warps=2, blocks_per_sm=1)


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
@pytest.mark.parametrize("n, k, plan, epilogue", [
    (16, 256, GemvPlan(rows=4, depth=2), "plain"),    # 4 tiles: 4 of the block's 8 warps have none
    (24, 384, GemvPlan(rows=2, depth=3), "bias"),     # K/32 = 12 chunks: lanes 12..31 idle
    (16, 1152, GemvPlan(rows=1, depth=1), "residual"),  # out += W x; 36 chunks: lanes 0..3 take 2 steps
    (16, 384, GemvPlan(rows=2, depth=2), "float16"),  # out_dtype float16
    (18, 256, PIPELINED, "bias"),       # one step a tile: 5, 5, 4, 4 tiles a warp, loads 4 tiles ahead
    (12, 1152, PIPELINED, "residual"),  # two steps a tile (the second with 4 lanes): ahead across tiles
    # The residual epilogue reads h before the wait, lane 32 j + L for tile 32 j + L of its warp:
    (160, 256, PIPELINED, "residual"),  # 40 tiles a warp: two rounds of 32 lanes
    (80, 256, GemvPlan(rows=4, depth=2, warps=1, blocks_per_sm=1), "residual"),  # 10 tiles of 4 rows: 2 rounds of 8
    # split_tiles (work split in gemv_int4_kernel.py): the warp holding a tile's last step adds the
    # partials the warps before it left in shared memory.
    (8, 4096, GemvPlan(rows=1, depth=2, warps=8, blocks_per_sm=1, split_tiles=True), "residual"),  # each tile on 2 warps
    (4, 8192, GemvPlan(rows=1, depth=4, warps=8, blocks_per_sm=1, split_tiles=True), "bias"), # each tile on 4 warps
    (6, 3072, GemvPlan(rows=1, depth=3, warps=4, blocks_per_sm=1, split_tiles=True), "plain"), # runs of 2, 2, 2, 3 items
    (12, 2048, GemvPlan(rows=2, depth=2, warps=4, blocks_per_sm=1, split_tiles=True), "bias"), # runs of 1, 2, 1, 2
])
def test_gemv_exact_activations(path, n, k, plan, epilogue):
    rng = np.random.default_rng()
    qweight, scales, w = random_linear(rng, n, k)
    x = exact_activations(rng, k)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out = rng.standard_normal(n).astype(np.float32)  # fresh contents: residual adds to them
    out_dtype = "float16" if epilogue == "float16" else "float32"
    gemv = make_gemv_int4(n, k, qweight, scales, path=path, bias=bias, out_dtype=out_dtype, plan=plan)
    y = run(gemv, x, out.astype(out_dtype), residual=epilogue == "residual")
    x_used = activations_used(gemv, k, path, x.astype(np.float64))
    expected = w @ x_used
    bound = float32_bound(w, x_used, k)
    if epilogue == "bias":
        expected += bias
    if epilogue == "residual":
        expected += out
        bound += U32 * np.abs(expected)
    if epilogue == "float16":
        bound += U16 * np.abs(expected)  # the final rounding to FP16
    assert np.all(np.abs(y - expected) <= bound)


def test_prmt_gaussian_activations_within_fp16_accumulation_bound():
    rng = np.random.default_rng()
    n, k = 16, 2176  # 68 chunks: lanes 0..3 take 3 steps
    qweight, scales, w = random_linear(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    gemv = make_gemv_int4(n, k, qweight, scales, path="prmt", plan=GemvPlan(rows=4))
    y = run(gemv, x, np.zeros(n, np.float32))
    magnitude = np.abs(w) @ np.abs(x.astype(np.float64))
    error = np.abs(y - w @ x.astype(np.float64))
    assert np.all(error <= 16 * U16 * magnitude + float32_bound(w, x, k))


def test_dp4a_gaussian_activations_within_int8_rounding_bound():
    rng = np.random.default_rng()
    n, k = 16, 256
    qweight, scales, w = random_linear(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    gemv = make_gemv_int4(n, k, qweight, scales, path="dp4a", plan=GemvPlan(rows=2))
    y = run(gemv, x, np.zeros(n, np.float32))
    x_used, x_scale = dequantized_activations(gemv, k)
    x64 = x.astype(np.float64)
    groups = x64.reshape(-1, 128)
    assert np.array_equal(x_scale, (np.abs(groups).max(axis=1).astype(np.float32) / np.float32(127)))
    rounding = np.repeat(x_scale.astype(np.float64), 128) / 2 + 2.0**-22 * np.abs(x64)
    assert np.all(np.abs(x_used - x64) <= rounding)
    bound = np.abs(w) @ rounding + float32_bound(w, x_used, k)
    assert np.all(np.abs(y - w @ x64) <= bound)


@pytest.mark.parametrize("outliers", [False, True])
def test_fixed16_gaussian_activations_within_rounding_bound(outliers):
    """Against x itself: oracles.gemv_oracle's bound, sum |s w| (x_scale/2 + 2^-22 |x|) over the
    16-bit rounding of each 32-input chunk plus the float32 term. With outliers (a few inputs 300
    times the rest, as LLM activations have) only their chunks lose resolution."""
    rng = np.random.default_rng()
    n, k = 16, 2176  # 68 chunks: lanes 0..3 take 3 steps
    qweight, scales, _ = random_linear(rng, n, k)
    x = rng.standard_normal(k)
    if outliers:
        x[rng.choice(k, 5, replace=False)] *= 300
    x = x.astype(np.float16)
    gemv = make_gemv_int4(n, k, qweight, scales, path="fixed16", plan=GemvPlan(rows=4))
    y = run(gemv, x, np.zeros(n, np.float32))
    expected, bound = gemv_oracle(qweight, scales, x, "fixed16")
    assert np.all(np.abs(y - expected) <= bound)


def gaussian_fused_rmsnorm_run(path):
    """A 16 x 1152 GEMV with a fused RMSNorm (eps 1e-6) of Gaussian h on `path`: (qweight, scales,
    w float64, xn = float64 RMSNorm(h) * weight, the kernel's output)."""
    rng = np.random.default_rng()
    n, k, eps = 16, 1152, 1e-6
    qweight, scales, w = random_linear(rng, n, k)
    h = (3.0 * rng.standard_normal(k)).astype(np.float32)
    weight = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float16)
    h64 = h.astype(np.float64)
    xn = h64 / np.sqrt(np.mean(h64**2) + eps) * weight.astype(np.float64)
    gemv = make_gemv_int4(n, k, qweight, scales, path=path, plan=GemvPlan(rows=2), norm_weight=weight,
                          norm_eps=eps)
    return qweight, scales, w, xn, run(gemv, h, np.full(n, np.nan, np.float32))


def test_fixed16_fused_rmsnorm_gaussian_within_bound():
    """Gaussian h, eps 1e-6: against float64 RMSNorm then W xn. xn stays float32 until it is
    quantized, so its error is the float32 steps' (< 8 u32 relative), passed to the oracle as
    input_error."""
    qweight, scales, _, xn, y = gaussian_fused_rmsnorm_run("fixed16")
    expected, bound = gemv_oracle(qweight, scales, xn, "fixed16", input_error=8 * U32 * np.abs(xn))
    assert np.all(np.abs(y - expected) <= bound)


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
@pytest.mark.parametrize("n, k, plan", [
    (16, 1152, GemvPlan(rows=2, depth=2)),
    (10, 1152, PIPELINED),
    (10, 1152, GemvPlan(rows=1, depth=4, warps=2, blocks_per_sm=1, split_tiles=True)),  # a tile on both warps
    (4, 4096, GemvPlan(rows=1, depth=2, warps=8, blocks_per_sm=1, split_tiles=True)),  # each tile on 4 warps
])
def test_gate_up_silu(path, n, k, plan):
    rng = np.random.default_rng()
    gate_q, gate_s, wg = random_linear(rng, n, k)
    up_q, up_s, wu = random_linear(rng, n, k)
    x = exact_activations(rng, k)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path=path, plan=plan)
    y = run(mlp, x, np.zeros(n, np.float16)).astype(np.float64)
    x_used = activations_used(mlp, k, path, x.astype(np.float64))
    g, u = wg @ x_used, wu @ x_used
    silu = g / (1 + np.exp(-g))
    expected = silu * u
    # FP16 output rounding, plus the float32 errors of g and u carried through silu (slope <= 1.1)
    # and the product, plus float32 exp/divide/multiply (a few u32 of the result).
    bound = (U16 + 8 * U32) * np.abs(expected) + 1.1 * np.abs(u) * float32_bound(wg, x_used, k) \
        + np.abs(silu) * float32_bound(wu, x_used, k)
    assert np.all(np.abs(y - expected) <= bound)


def normed_inputs(rng, k):
    """h = +-2 and norm weight m/8 (|m| <= 8): with eps 0 and K a power of two, mean h^2 = 4 and
    the RMSNorm scale 1/2 are exact in float32, so xn = h/2 * weight = +-m/8 exactly."""
    h = (2.0 * rng.choice([-1.0, 1.0], size=k)).astype(np.float32)
    weight = exact_activations(rng, k)
    return h, weight, (h.astype(np.float64) / 2) * weight


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
@pytest.mark.parametrize("n, k, rows", [(16, 256, 4), (24, 1024, 2)])
def test_gemv_fused_rmsnorm_exact(path, n, k, rows):
    rng = np.random.default_rng()
    qweight, scales, w = random_linear(rng, n, k)
    h, weight, xn = normed_inputs(rng, k)
    bias = rng.standard_normal(n).astype(np.float16)
    gemv = make_gemv_int4(n, k, qweight, scales, path=path, bias=bias, plan=GemvPlan(rows=rows, depth=2),
                          norm_weight=weight, norm_eps=0.0)
    y = run(gemv, h, np.full(n, np.nan, np.float32))
    if path == "dp4a":  # the norm ran as its own kernel into the object's workspace
        assert np.array_equal(gemv._input.xn.copy_to_host().astype(np.float64), xn)
    x_used = activations_used(gemv, k, path, xn)
    assert np.all(np.abs(y - (w @ x_used + bias)) <= float32_bound(w, x_used, k))


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
def test_gate_up_silu_fused_rmsnorm_exact(path):
    rng = np.random.default_rng()
    n, k = 16, 1024
    gate_q, gate_s, wg = random_linear(rng, n, k)
    up_q, up_s, wu = random_linear(rng, n, k)
    h, weight, xn = normed_inputs(rng, k)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path=path, plan=PIPELINED,
                            norm_weight=weight, norm_eps=0.0)
    y = run(mlp, h, np.zeros(n, np.float16)).astype(np.float64)
    x_used = activations_used(mlp, k, path, xn)
    g, u = wg @ x_used, wu @ x_used
    silu = g / (1 + np.exp(-g))
    expected = silu * u
    bound = (U16 + 8 * U32) * np.abs(expected) + 1.1 * np.abs(u) * float32_bound(wg, x_used, k) \
        + np.abs(silu) * float32_bound(wu, x_used, k)  # as test_gate_up_silu
    assert np.all(np.abs(y - expected) <= bound)


def test_prmt_fused_rmsnorm_gaussian_within_bound():
    """Gaussian h, eps 1e-6, K not a power of two: against float64 RMSNorm then W xn.

    Bound: xn's float32 steps (sum of squares, sqrt, divide, two multiplies: < 8 u32 relative)
    and its FP16 rounding (u16) per input, times |s w|; then test_prmt_gaussian's FP16
    accumulation bound and the float32 bound, both over |xn|.
    """
    _, _, w, xn, y = gaussian_fused_rmsnorm_run("prmt")
    k = len(xn)
    magnitude = np.abs(w) @ np.abs(xn)
    bound = (U16 + 8 * U32) * magnitude + 16 * U16 * (1 + U16) * magnitude + float32_bound(w, xn, k)
    assert np.all(np.abs(y - w @ xn) <= bound)


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
@pytest.mark.parametrize("k, plan", [
    (256, GemvPlan(rows=2, depth=3, warps=2, blocks_per_sm=1)),
    (2048, GemvPlan(rows=2, depth=2, warps=3, blocks_per_sm=1, split_tiles=True)),  # 128 items a block on 3 warps: split tiles
    (256, GemvPlan(rows=2, depth=2, warps=1, blocks_per_sm=1)),  # 64 tiles a warp: bias and angles read in 2 rounds
])
def test_qkv_rope_kv_write(path, k, plan):
    """The QKV GEMV with the RoPE + KV-write epilogue against float64: W x + b, rotated by the float64
    angles of the position (q into q, k into its page slot), v copied; every other slot untouched.

    Bound per output: the GEMV's float32 bound for each of the pair's two rows (e1, e2), carried
    through the rotation (|cos| e1 + |sin| e2 <= e1 + e2), the rotation's own float32 rounding
    (16 u32 (|x1| + |x2|), as kernels/rope_kv_write's tests), and for K/V the FP16 store
    (u16 |y| + 2^-25)."""
    from pynanoqwen.kernels.kv_layout import swizzle_rows
    from pynanoqwen.kernels.page_alloc import PAGE_SIZE as PAGE
    from pynanoqwen.kernels.rope_kv_write import rope_cos_sin

    rng = np.random.default_rng()
    heads, kv_heads, hd, pages = 2, 1, 64, 5  # two query heads per KV head, as in grouped attention
    n = (heads + 2 * kv_heads) * hd
    qweight, scales, w = random_linear(rng, n, k)
    bias = rng.standard_normal(n).astype(np.float16)
    x = exact_activations(rng, k)
    position = int(rng.integers(0, pages * PAGE))
    page_table = rng.permutation(pages).astype(np.int32)
    cos, sin = rope_cos_sin(hd, 10000.0, pages * PAGE)
    k_init = rng.standard_normal((pages, kv_heads, PAGE, hd)).astype(np.float16)
    v_init = rng.standard_normal((pages, kv_heads, PAGE, hd)).astype(np.float16)
    q, k_pages, v_pages = (cuda.to_device(a) for a in (np.full((heads, hd), np.nan, np.float32), k_init, v_init))
    gemv = make_gemv_int4(n, k, qweight, scales, path=path, bias=bias, rope_heads=(heads, kv_heads, hd),
                          plan=plan)
    gemv.launch_rope(0, cuda.to_device(x), q, k_pages, v_pages, cuda.to_device(page_table),
                     cuda.to_device(np.array([position], np.int32)), cuda.to_device(cos), cuda.to_device(sin))

    x_used = activations_used(gemv, k, path, x.astype(np.float64))
    qkv = (w @ x_used + bias).reshape(-1, hd)
    error = (float32_bound(w, x_used, k) + U32 * np.abs(qkv.reshape(-1))).reshape(-1, hd)
    half = hd // 2
    angle = position * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    x1, x2 = qkv[:, :half], qkv[:, half:]
    rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], 1)
    rot_bound = np.tile(error[:, :half] + error[:, half:] + 16 * U32 * (np.abs(x1) + np.abs(x2)), 2)
    page, slot = page_table[position // PAGE], position % PAGE
    # In dim order (kernels/kv_layout.py), the init too, so that untouched slots compare alike.
    k_got, v_got = swizzle_rows(k_pages.copy_to_host()), swizzle_rows(v_pages.copy_to_host())
    k_init, v_init = swizzle_rows(k_init), swizzle_rows(v_init)
    assert np.all(np.abs(q.copy_to_host() - rotated[:heads]) <= rot_bound[:heads])
    k_rot = rotated[heads:heads + kv_heads]
    assert np.all(np.abs(k_got[page, :, slot] - k_rot) <= rot_bound[heads:heads + kv_heads]
                  + U16 * np.abs(k_rot) + 2.0**-25)
    v = qkv[heads + kv_heads:]
    assert np.all(np.abs(v_got[page, :, slot] - v) <= error[heads + kv_heads:] + U16 * np.abs(v) + 2.0**-25)
    untouched = np.ones(k_init.shape[:3], bool)
    untouched[page, :, slot] = False
    assert np.array_equal(k_got[untouched], k_init[untouched]) and np.array_equal(v_got[untouched], v_init[untouched])


@pytest.mark.parametrize("path", ["prmt", "fixed16"])
def test_qkv_rope_whole_tile_plans_give_the_same_bits(path):
    """A whole-tile plan computes each tile in one warp, in the same order whatever the warp count,
    so a plan whose warps take several tiles each and one whose warps take one each must write the
    same q, K and V bits (dev/gemv_plans.py sweeps QKV at more warps for that reason)."""
    from pynanoqwen.device import sm_count
    from pynanoqwen.kernels.page_alloc import PAGE_SIZE as PAGE
    from pynanoqwen.kernels.rope_kv_write import rope_cos_sin

    rng = np.random.default_rng()
    heads, kv_heads, hd, pages, k = 1, 1, 64, 3, 256  # 96 row-pair tiles (64 dims: kernels/kv_layout.py)
    n = (heads + 2 * kv_heads) * hd
    qweight, scales, _ = random_linear(rng, n, k)
    bias = rng.standard_normal(n).astype(np.float16)
    x = cuda.to_device(exact_activations(rng, k))
    position = int(rng.integers(0, pages * PAGE))
    page_table = cuda.to_device(rng.permutation(pages).astype(np.int32))
    cos, sin = (cuda.to_device(t) for t in rope_cos_sin(hd, 10000.0, pages * PAGE))
    plans = [GemvPlan(rows=2, depth=4, warps=1, blocks_per_sm=1), GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=6)]
    tiles_a_warp = [-(-(n // 2) // (plan.grid(n, sm_count()) * plan.warps)) for plan in plans]
    assert tiles_a_warp[0] > 1 and tiles_a_warp[1] == 1, tiles_a_warp
    outputs = []
    for plan in plans:
        q = cuda.to_device(np.full((heads, hd), np.nan, np.float32))
        k_pages, v_pages = (cuda.to_device(np.zeros((pages, kv_heads, PAGE, hd), np.float16)) for _ in range(2))
        gemv = make_gemv_int4(n, k, qweight, scales, path=path, bias=bias, rope_heads=(heads, kv_heads, hd), plan=plan)
        gemv.launch_rope(0, x, q, k_pages, v_pages, page_table, cuda.to_device(np.array([position], np.int32)), cos, sin)
        assert np.isfinite(q.copy_to_host()).all()  # every q written (it started as NaN)
        outputs.append([a.copy_to_host().view(np.uint16 if a.dtype == np.float16 else np.uint32)
                        for a in (q, k_pages, v_pages)])
    assert all(np.array_equal(a, b) for a, b in zip(*outputs))


def test_fused_mlp_variant_matches_float64():
    """dev/mlp_fused.py (gate/up, SiLU, down_proj and the residual in one kernel, blocks owning
    slices of the intermediate rows) at hidden 128, intermediate 256 on 3 blocks of 2 warps, so
    blocks own 5, 5 and 6 units and two of them straddle a scale group: both down_proj layouts on
    the exact inputs (mlp known to a few u16, so a wrong column, unit or scale shows), the tiled one
    on Gaussian inputs too. The simulator runs blocks one at a time, so the variants run as two
    launches (their grid barrier needs every block resident: the GPU check runs it)."""
    from mlp_fused import check

    variants = {"tiled": dict(layout="tiled", barrier=False), "rows": dict(layout="rows", barrier=False)}
    rng = np.random.default_rng()
    results = check(rng, 128, 256, 3, 2, variants, cases=("exact",), launches=1)
    results += check(rng, 128, 256, 3, 2, {"tiled": variants["tiled"]}, cases=("gaussian",), launches=1)
    assert len(results) == 3 and all(r.status == "PASS" for r in results), [r.line() for r in results]


def test_bulk_ring_gemv_variant_matches_float64():
    """dev/gemv_bulk_ring.py (the residual GEMV fed by cp.async.bulk into a shared-memory ring) at
    N 10, K 512 on 3 blocks (3, 3 and 4 rows), rings of 2 stages so every block refills a stage
    after its consumers release it: one row a stage on 2 warps; two rows a stage on 4 warps, a
    group a row; and four rows a stage on 2 warps of one group, each lane reusing its x chunk over
    the four rows (in the blocks of 3 rows the stage's fourth row is past the block's end); with 1,
    2 and 4 FP16 accumulator chains a chunk."""
    from gemv_bulk_ring import Setting, check

    settings = [Setting(1, 2, 2, 1), Setting(2, 2, 4, 2, 2), Setting(4, 2, 2, 1, 4)]
    results = check(np.random.default_rng(), shapes={"tiny": (10, 512)}, grid=3, settings={"tiny": settings},
                    launches=2)
    assert len(results) == 6 and all(r.status == "PASS" for r in results), [r.line() for r in results]


def test_mma_gemv_variant_matches_float64():
    """dev/gemv_mma.py (the GEMV on mma.sync, the offsets taken off per group) at N 32, K 512: two
    tiles of four groups. One warp walks both tiles with 4 items in flight (its pipeline crosses
    the tile boundary); 3 warps of one block take runs of 2, 3 and 3 items, so the middle warp
    holds a partial of both tiles (its slots 0 and 1) and each tile is merged by the last of its
    two warps to count in; 2 blocks of 2 warps split each tile between two warps of one block; and the 3 warps again on
    the weights repacked in item order (blocked_layout)."""
    from gemv_mma import Setting, check

    cases = [(1, Setting(1, 1, 4)), (1, Setting(3, 1, 2)), (2, Setting(2, 1, 3)), (1, Setting(3, 1, 2, True))]
    results = []
    for grid, setting in cases:
        results += check(np.random.default_rng(), shapes={"tiny": (32, 512)}, grid=grid, settings=[setting],
                         launches=2)
    assert len(results) == 8 and all(r.status == "PASS" for r in results), [r.line() for r in results]
