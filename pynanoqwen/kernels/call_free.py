"""Float32 division, and the SiLU built on it, without the subroutine call that `/` makes.

Numba turns `x / y` on float32 into a correctly rounded `div.rn.f32`, which ptxas builds as a
subroutine for its slow path, and a kernel that makes any call gets all its wgmmas run one at a
time (docs/HARDWARE.md, "numba-cuda": ptxas C7509). So kernels with wgmma divide with `divide`:
the wgmma GEMM's gate/up epilogue takes `silu` from here (the prefill gate_up GEMM ran serialized
at every tile until 2026-12-05). Kernels without wgmma keep `/`: the mma.sync GEMM and the decode
GEMV write silu as g / (1 + exp(-g)): with this longer form in its epilogue the mma.sync GEMM's
128 x 128 tile (dev/gemm_mma_sync_large.py) put its accumulators in 512 bytes of local memory,
which it does not with `/`. The two forms agree but in rare last places and below g = -80.

divide(x, y), for y and x / y in the normal range:

    r = div.approx(1, y)                 2 ulp (PTX ISA: for |y| in [2^-126, 2^126])
    r = fma(r, fma(-y, r, 1), r)         one Newton step: within 1/2 ulp of 1 / y, + ~2^-44
    q = x r
    q = fma(fma(-y, q, x), r, q)         Markstein's correction

The residual fma(-y, q, x) is exact, so the last step leaves the rounding of x / y and a term of
|x / y - q| x 2^-24 (q is within 2 ulp): within 1/2 ulp + ~2^-44 relative, the budget of one
correctly rounded division. Emulated in numpy with the first reciprocal 2 ulp off either way, it
gave the correctly rounded quotient for all of 60000 random silu arguments (a scratch check).

silu(g) = g / (1 + e^-g) divides by y = 1 + e^-g with the exponent capped at 80 (g < -80): y
stays finite and below 2^126, where e^-g = inf would make the Newton step inf x 0 = NaN; the result
is then g / (1 + e^80), within |g| 2^-115 of silu(g) and, like it, far below the smallest float16.
So the epilogues' error budget (oracles.silu_product_oracle: 8 u32 for exp, add, divide and
multiply) holds as with `/`.

The simulator has no libdevice: it divides 1 / y there, then takes the same steps.
"""

from __future__ import annotations

import math

from numba import cuda, float32
from numba.cuda import libdevice

from ..ptx import SIMULATOR
from ..ptx.fma import fma

EXPONENT_CAP = float32(80.0)
ONE = float32(1.0)


@cuda.jit(device=True, inline="always")
def divide(x, y):
    """x / y for float32 x, y (module docstring: within 1/2 ulp + ~2^-44 relative)."""
    r = ONE / y if SIMULATOR else libdevice.fast_fdividef(ONE, y)
    r = fma(r, fma(-y, r, ONE), r)
    q = x * r
    return fma(fma(-y, q, x), r, q)


@cuda.jit(device=True, inline="always")
def silu(g):
    """g / (1 + e^-g) for a float32 g."""
    return divide(g, ONE + math.exp(min(-g, EXPONENT_CAP)))
