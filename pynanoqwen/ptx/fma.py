"""`fma.rn.f32`: a * b + c rounded once to float32 (round to nearest even).

PTX ISA, Floating Point Instructions: fma. The instruction numba's `cuda.fma` lowers to, spelled
here as inline PTX for its simulator twin (`cuda.fma` cannot be passed around as a function, so it
cannot be swapped for one). The simulator's `cuda.fma` is `a * b + c` in Python: with float32
operands the product rounds to float32 and the sum again, two roundings where the GPU does one.
Kernels rely on the one rounding:
- the fixed16 staging (kernels/gemv_int4_paths.py, fixed16_quad) rounds x * inverse to an integer
  by fma(x, inverse, 1.5 * 2^23); rounded twice, a product within 2^-10 of k + 1/2 first becomes
  k + 1/2 and then the even neighbour, so a simulated v was one off the GPU's in about one input of
  2000 (23.5% of tests/sim/test_gemv_group_sim.py's draws of 512), and the simulator tests that
  model the staging in numpy (that one and tests/sim/test_gemv_sim.py) failed now and then
  (docs/PERFORMANCE.md, lessons);
- the call-free divide (kernels/call_free.py) and the attention merges' rescale.

The twin rounds once: for float32 a, b, c the product a * b is exact in float64 (48 bits), the
float64 sum s and its exact error e come from TwoSum, and s is moved one float64 ulp towards e
when e != 0 and s is even (round to odd). Rounding a round-to-odd value of at least p + 2 bits to
p bits gives the correctly rounded result (Boldo and Melquiond, "Emulation of FMA and correctly
rounded sums: proved algorithms using rounding to odd", 2008), and 53 >= 24 + 2.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def fma_simulated(a, b, c):
    """float32(a * b + c), rounded once."""
    a, b, c = (float(np.float32(v)) for v in (a, b, c))
    product = a * b  # exact: two 24-bit significands
    total = product + c
    if not math.isfinite(total):
        return np.float32(total)
    back = total - product
    error = (product - (total - back)) + (c - back)  # TwoSum: total + error == product + c exactly
    if error != 0 and math.frexp(total)[0] * 2.0**53 % 2 == 0:
        total = math.nextafter(total, math.inf if error > 0 else -math.inf)
    return np.float32(total)


@simulator_twin(fma_simulated)
@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c of three float32, rounded once: `fma.rn.f32 d, a, b, c`."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        asm = ir.InlineAsm(ir.FunctionType(f32, [f32] * 3), "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f")
        return builder.call(asm, list(args))

    return types.float32(a, b, c), codegen
