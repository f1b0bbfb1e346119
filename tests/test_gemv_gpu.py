"""INT4 GEMV on the GPU: both paths at every 7B linear shape against float64 numpy on fresh random
weights and activations, and the bandwidth each reaches (run with -s to see it).

Tolerances are oracles.gemv_oracle's bounds, derived in tests/sim/test_gemv_sim.py (u16 = 2^-11,
u32 = 2^-24): prmt |error| <= 16 u16 sum|s w x| (FP16 accumulation over one lane's 16 products per
half) plus (K/32 + 8) u32 sum|s w x| (float32); dp4a and fixed16 sum |s w| (x_scale/2 + 2^-22 |x|)
(x rounded to integers) plus the same float32 term. dev/gemv_plans.py times other GemvPlans.
"""

import numpy as np
import pytest

from pynanoqwen.kernels.gemv_int4 import GemvPlan, default_plan, gemv_bytes, make_gate_up_silu, make_gemv_int4
from pynanoqwen.gpu_timing import time_gemv
from pynanoqwen.oracles import gemv_oracle

pytestmark = pytest.mark.gpu

U16, U32 = 2.0**-11, 2.0**-24
HIDDEN, INTERMEDIATE, QKV, VOCAB = 3584, 18944, 4608, 152064
ROOFLINE = 4.3e12  # bytes/s, H200 with 16-byte loads (docs/HARDWARE.md)


def random_int4(rng, n, k):
    """Random packed words (all 16 nibble values) and signed FP16 scales of a typical size."""
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = (rng.uniform(0.005, 0.02, size=(n, k // 128)) * rng.choice([-1, 1], size=(n, k // 128)))
    return qweight, scales.astype(np.float16)


def run_gemv(gemv, x, out, **epilogue):
    from numba import cuda

    stream = cuda.stream()
    out_device = cuda.to_device(out, stream=stream)
    gemv.launch(stream, cuda.to_device(x, stream=stream), out_device, **epilogue)
    result = out_device.copy_to_host(stream=stream)
    stream.synchronize()
    return result


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
@pytest.mark.parametrize("name, n, k, epilogue", [
    ("qkv", QKV, HIDDEN, "bias"),
    ("o_proj", HIDDEN, HIDDEN, "residual"),
    ("down_proj", HIDDEN, INTERMEDIATE, "residual"),
    ("lm_head", VOCAB, HIDDEN, "plain"),
])
def test_gemv_7b_shapes(path, name, n, k, epilogue):
    rng = np.random.default_rng()
    qweight, scales = random_int4(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    out = rng.standard_normal(n).astype(np.float32)
    gemv = make_gemv_int4(n, k, qweight, scales, path=path, bias=bias)
    y = run_gemv(gemv, x, out, residual=epilogue == "residual")
    expected, bound = gemv_oracle(qweight, scales, x, path)
    if bias is not None:
        expected += bias
    if epilogue == "residual":
        expected += out
        bound += U32 * np.abs(expected)
    worst = np.argmax(np.abs(y - expected) / bound)
    assert np.all(np.abs(y - expected) <= bound), (name, worst, y[worst], expected[worst], bound[worst])


@pytest.mark.parametrize("path", ["prmt", "dp4a", "fixed16"])
def test_gate_up_silu_7b_shape(path):
    rng = np.random.default_rng()
    n, k = INTERMEDIATE, HIDDEN
    gate_q, gate_s = random_int4(rng, n, k)
    up_q, up_s = random_int4(rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path=path)
    y = run_gemv(mlp, x, np.zeros(n, np.float16)).astype(np.float64)
    g, bound_g = gemv_oracle(gate_q, gate_s, x, path)
    u, bound_u = gemv_oracle(up_q, up_s, x, path)
    silu = g / (1 + np.exp(-g))
    expected = silu * u
    # FP16 output rounding and float32 silu/product, plus g's and u's errors carried through
    # silu (slope <= 1.1) and the product.
    bound = (U16 + 8 * U32) * np.abs(expected) + 1.1 * np.abs(u) * bound_g + (np.abs(silu) + 1.1 * bound_g) * bound_u
    assert np.all(np.abs(y - expected) <= bound)


def test_gemv_bandwidth_report():
    rng = np.random.default_rng()
    print("\nshape                 path  plan                      us/call   GB/s  % of 4.3 TB/s")
    for name, n, k in [("qkv", QKV, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("gate_up", INTERMEDIATE, HIDDEN),
                       ("down_proj", HIDDEN, INTERMEDIATE), ("lm_head", VOCAB, HIDDEN)]:
        matrices = 2 if name == "gate_up" else 1
        weights = [random_int4(rng, n, k) for _ in range(matrices)]
        nbytes = matrices * gemv_bytes(n, k)
        for path in ("prmt", "dp4a", "fixed16"):
            if matrices == 2:
                def build(path=path):
                    (gq, gs), (uq, us) = weights
                    return make_gate_up_silu(n, k, gq, gs, uq, us, path=path)
            else:
                def build(path=path):
                    return make_gemv_int4(n, k, *weights[0], path=path)
            seconds = time_gemv(build, nbytes, np.float16 if matrices == 2 else np.float32)
            label = f"{name} {n}x{k}" + (" x2" if matrices == 2 else "")
            plan = default_plan(n, k, matrices)
            print(f"{label:21s} {path:5s} R{plan.rows} D{plan.depth} W{plan.warps} B{plan.blocks_per_sm}"
                  f"{seconds * 1e6:26.2f} {nbytes / seconds / 1e9:6.0f}  {100 * nbytes / seconds / ROOFLINE:5.1f}")
            # Faster than HBM would mean the weights came from L2: the measurement is broken.
            assert nbytes / seconds < 1.15 * ROOFLINE


@pytest.mark.parametrize("n, k, plan", [
    (HIDDEN, INTERMEDIATE, None),  # down_proj: its default plan splits tiles
    (HIDDEN, HIDDEN, GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2, split_tiles=True)),
])
def test_split_tiles_give_the_same_bits_eager_plain_and_in_a_graph(n, k, plan):
    """Split tiles add their warps' partials in a fixed order (no atomics), so programmatic and
    plain launches and graph replays must agree bit for bit (the split-K atomics lesson)."""
    from numba import cuda

    from pynanoqwen.graphs import capture
    from pynanoqwen.launch import plain_launches

    rng = np.random.default_rng()
    qweight, scales = random_int4(rng, n, k)
    gemv = make_gemv_int4(n, k, qweight, scales, plan=plan)
    assert gemv.plan.split_tiles
    stream = cuda.stream()
    x = cuda.to_device(rng.standard_normal(k).astype(np.float16), stream=stream)
    outs = [cuda.device_array(n, np.float32, stream=stream) for _ in range(4)]
    gemv.launch(stream, x, outs[0])
    with plain_launches():
        gemv.launch(stream, x, outs[1])
    graph = capture(stream, lambda: gemv.launch(stream, x, outs[2]))
    graph.launch(stream)
    graph.launch(stream)
    gemv.launch(stream, x, outs[3])
    got = [o.copy_to_host(stream=stream) for o in outs]
    stream.synchronize()
    graph.close()
    assert np.all(np.isfinite(got[0])) and np.any(got[0] != 0)
    for other in got[1:]:
        assert np.array_equal(got[0], other)
