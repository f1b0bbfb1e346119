"""kernels/call_free.py in the CUDA simulator: divide and silu within their share of the gate/up
epilogues' error budget, on fresh random inputs.

The simulator starts from 1 / y rounded once (it has no div.approx), but its fma rounds the product
before the add (numba-cuda's simulator computes a * b + c), so the residuals of the Newton step and
of Markstein's correction are not exact there, as they are on the GPU: divide is checked to within
one ulp of x / y (2 u32 relative), the division's share of oracles.silu_product_oracle's 8 u32
(exp 4, add 1, divide 2, multiply 1 on the GPU, where the division comes out within 1/2 ulp).
silu(g) against float64 g / (1 + e^-g): the simulator's float32 exp is rounded once (u32), the add
once, e's error reaches y at most whole, and the division: 5 u32 relative. Below g = -80 the capped
exponent leaves |g| 2^-115 absolute at most (module docstring).
"""

import math

import numpy as np
from numba import cuda

from pynanoqwen.kernels.call_free import divide, silu

U32 = 2.0**-24


@cuda.jit
def apply(x, y, quotient, silu_of_x):
    i = cuda.grid(1)
    if i < x.size:
        quotient[i] = divide(x[i], y[i])
        silu_of_x[i] = silu(x[i])


def run(x, y):
    quotient, silu_of_x = np.zeros_like(x), np.zeros_like(x)
    apply[(x.size + 63) // 64, 64](x, y, quotient, silu_of_x)
    return quotient, silu_of_x


def test_divide_within_one_ulp():
    rng = np.random.default_rng()
    x = (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 7, 256)).astype(np.float32)
    y = (rng.uniform(0.5, 2, 256) * 10.0 ** rng.integers(-6, 7, 256) * rng.choice([-1, 1], 256)).astype(np.float32)
    quotient, _ = run(x, y)
    expected = x.astype(np.float64) / y.astype(np.float64)
    error = np.abs(quotient - expected) / np.abs(expected)
    assert np.all(error <= 2 * U32), (error.max() / U32, np.flatnonzero(error > 2 * U32)[:8])


def test_silu_against_float64():
    rng = np.random.default_rng()
    g = np.concatenate([rng.standard_normal(200) * 8, rng.uniform(-200, 200, 48),
                        [-1e4, -89.0, -80.5, -80.0, -1e-30, 0.0, 1e-30, 88.0, 1e4]]).astype(np.float32)
    _, got = run(g, np.ones_like(g))
    g64 = g.astype(np.float64)
    expected = np.array([v / (1 + math.exp(-v)) if v > -700 else 0.0 for v in g64])
    bound = np.where(g64 >= -80, 5 * U32 * np.abs(expected), np.abs(g64) * 2.0**-115)
    assert np.all(np.abs(got - expected) <= bound), g[np.abs(got - expected) > bound][:8]
