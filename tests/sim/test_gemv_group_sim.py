"""dev/gemv_group.py (lanes owning weight groups) under the simulator at tiny sizes, on fresh random
inputs: against float64 of the activations as it stages them (staged_activations: only float32
rounding remains, so a layout, unpack or row-parking mistake shows), against float64 of x itself
(group_bound), and bit for bit run to run.

Shapes: K = 512 (4 units a row, one step whatever R) and K = 1536 (12 units a row: at R = 8 a lane's
three units of a tile lie in three rows, which exercises parking), N = 32 on one or two warps, so a
warp computes several tiles; units of one row and of two (one x record for both). The float32
bound (derived in group_bound): at most K/32 + 8 roundings of u32 sum |w x|.
"""

import numpy as np
import pytest
from numba import cuda

from gemv_group import GroupGemv, Setting, group_bound, staged_activations
from pynanoqwen.oracles import U32
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.quant import dequantize_int4, quantize_int4

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

N = 32


@pytest.mark.parametrize("k, setting, grid", [
    (512, Setting(rows=1, warps=2, blocks_per_sm=1, depth=4), 1),
    (512, Setting(rows=8, warps=1, blocks_per_sm=1, depth=2), 2),
    (1536, Setting(rows=8, warps=1, blocks_per_sm=1, depth=3), 1),
    (1536, Setting(rows=2, warps=2, blocks_per_sm=1, depth=1), 2),
    (512, Setting(rows=2, warps=1, blocks_per_sm=1, depth=2, unit_rows=2), 2),
    (1536, Setting(rows=8, warps=2, blocks_per_sm=1, depth=3, unit_rows=2), 1),
])
def test_group_gemv_matches_float64(k, setting, grid):
    rng = np.random.default_rng()
    qweight, scales = quantize_int4(rng.standard_normal((N, k)).astype(np.float32))
    w = dequantize_int4(qweight, scales, np.float64)
    # Groups of very different magnitudes: a scale per group has to be per group.
    x = (rng.standard_normal(k) * np.repeat(rng.uniform(0.01, 4, k // 128), 128)).astype(np.float16)
    h = rng.standard_normal(N).astype(np.float32)
    gemv = GroupGemv(N, k, qweight, scales, grid, setting)
    outs = []
    for _ in range(2):
        out = cuda.to_device(h)
        gemv.launch(0, cuda.to_device(x), out)
        outs.append(out.copy_to_host().astype(np.float64) - h)  # the residual add rounds once more
    assert np.array_equal(outs[0], outs[1])
    got = outs[0]
    staged = staged_activations(x)
    exact = w @ staged
    float_bound = (k // 32 + 9) * U32 * (np.abs(w) @ np.abs(staged) + np.abs(h))
    assert np.all(np.abs(got - exact) <= float_bound), np.max(np.abs(got - exact) / float_bound)
    expected, bound = group_bound(qweight, scales, x)
    assert np.all(np.abs(got - expected) <= bound + U32 * np.abs(h) * 2)


def test_group_gemv_fused_rmsnorm_within_bound():
    """Gaussian h, eps 1e-6, against float64 RMSNorm(h) * weight then W xn: xn stays float32 until
    it is quantized, so its error is the float32 steps' (< 8 u32 relative, the product's fused
    norm's figure), passed to group_bound as input_error."""
    rng = np.random.default_rng()
    n, k, eps = 16, 1536, 1e-6
    qweight, scales = quantize_int4(rng.standard_normal((n, k)).astype(np.float32))
    h = (3.0 * rng.standard_normal(k)).astype(np.float32)
    weight = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float16)
    h64 = h.astype(np.float64)
    xn = h64 / np.sqrt(np.mean(h64**2) + eps) * weight.astype(np.float64)
    gemv = GroupGemv(n, k, qweight, scales, 1, Setting(rows=2, warps=2, blocks_per_sm=1, depth=2, unit_rows=2),
                     norm_weight=weight, norm_eps=eps)
    out = cuda.to_device(np.zeros(n, np.float32))
    gemv.launch(0, cuda.to_device(h), out)
    expected, bound = group_bound(qweight, scales, xn, input_error=8 * U32 * np.abs(xn))
    assert np.all(np.abs(out.copy_to_host() - expected) <= bound)


def test_group_gate_up_silu_within_bound():
    """The gate/up form: out float16 = silu(Wg x) * (Wu x) against float64 of the staged x, with
    the product's test_gate_up_silu bound: FP16 output rounding, the float32 errors of g and u
    carried through silu (slope <= 1.1) and the product, and a few u32 of float32 exp, divide and
    multiply."""
    rng = np.random.default_rng()
    n, k = 16, 1536
    (gate_q, gate_s), (up_q, up_s) = (quantize_int4(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(2))
    wg, wu = dequantize_int4(gate_q, gate_s, np.float64), dequantize_int4(up_q, up_s, np.float64)
    x = (0.1 * rng.standard_normal(k)).astype(np.float16)  # g and u of a few units: silu not saturated
    gemv = GroupGemv(n, k, gate_q, gate_s, 2, Setting(rows=2, warps=1, blocks_per_sm=1, depth=2), up_q=up_q, up_s=up_s)
    out = cuda.to_device(np.full(n, np.nan, np.float16))
    gemv.launch(0, cuda.to_device(x), out)
    y = out.copy_to_host().astype(np.float64)
    staged = staged_activations(x)
    g, u = wg @ staged, wu @ staged
    silu = g / (1 + np.exp(-g))
    expected = silu * u
    bound = (2.0**-11 + 8 * U32) * np.abs(expected) \
        + 1.1 * np.abs(u) * (k // 32 + 8) * U32 * (np.abs(wg) @ np.abs(staged)) \
        + np.abs(silu) * (k // 32 + 8) * U32 * (np.abs(wu) @ np.abs(staged))
    assert np.all(np.abs(y - expected) <= bound)


def test_group_qkv_rope_kv_write_within_bound():
    """The QKV form at a tiny attention shape (2 query heads, 1 KV head, head_dim 64: 256 rows, K
    512) and position 37: q, the K slot and the V slot against float64 of W x + bias rotated with
    the same float32 cos/sin tables. Bound: each row's GEMV bound (group_bound) and the bias add's
    rounding, carried through the rotation (|cos|, |sin| <= 1: e1 + e2), the rotation's own
    roundings (an FMA and a product: 4 u32 (|x1| + |x2|)), and the float16 store of K and V."""
    from pynanoqwen.kernels.kv_layout import swizzle_rows
    from pynanoqwen.kernels.rope_kv_write import rope_cos_sin

    rng = np.random.default_rng()
    heads, kv_heads, head_dim, k, position = 2, 1, 64, 512, 37
    n, half = (heads + 2 * kv_heads) * head_dim, head_dim // 2
    qweight, scales = quantize_int4(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal(k).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    cos, sin = rope_cos_sin(head_dim, 10000.0, 64)
    page_table = np.array([3, 1, 0, 2], np.int32)  # position 37: logical page 2 -> page 0, slot 5
    pages = lambda: cuda.to_device(np.full((4, kv_heads, 16, head_dim), np.nan, np.float16))  # noqa: E731
    q, k_pages, v_pages = cuda.to_device(np.full(heads * head_dim, np.nan, np.float32)), pages(), pages()
    gemv = GroupGemv(n, k, qweight, scales, 4, Setting(rows=2, warps=1, blocks_per_sm=1, depth=2, unit_rows=2),
                     heads=(heads, kv_heads, head_dim), bias=bias)
    gemv.launch_rope(0, cuda.to_device(x), q, k_pages, v_pages, cuda.to_device(page_table),
                     cuda.to_device(np.array([position], np.int32)), cuda.to_device(cos), cuda.to_device(sin))
    product, gemv_bound = group_bound(qweight, scales, x)
    qkv = product + bias.astype(np.float64)
    error = gemv_bound + U32 * np.abs(qkv)
    parts, errors = qkv.reshape(-1, head_dim), error.reshape(-1, head_dim)
    c, s = cos[position].astype(np.float64), sin[position].astype(np.float64)
    x1, x2, e1, e2 = parts[:, :half], parts[:, half:], errors[:, :half], errors[:, half:]
    rotated = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], 1)
    rotation_bound = np.concatenate([e1 + e2 + 4 * U32 * (np.abs(x1) + np.abs(x2))] * 2, 1)
    assert np.all(np.abs(q.copy_to_host().reshape(heads, head_dim) - rotated[:heads]) <= rotation_bound[:heads])
    k_slot = swizzle_rows(k_pages.copy_to_host()[0, 0])[5].astype(np.float64)  # dim order: kernels/kv_layout.py
    k_bound = rotation_bound[heads] + 2.0**-11 * np.abs(rotated[heads]) + 2.0**-25
    assert np.all(np.abs(k_slot - rotated[heads]) <= k_bound)
    v_slot = swizzle_rows(v_pages.copy_to_host()[0, 0])[5].astype(np.float64)
    v_bound = errors[heads + 1] + 2.0**-11 * np.abs(parts[heads + 1]) + 2.0**-25
    assert np.all(np.abs(v_slot - parts[heads + 1]) <= v_bound)
    assert np.isnan(k_pages.copy_to_host()[0, 0, 4]).all()  # nothing else written
