"""The INT4 unpack every kernel calls: one packed word -> its 8 signed weights as four exact half2.

A word of the ValueShuffle layout (pynanoqwen/quant.py) holds 8 consecutive weights of a row as
nibbles u = w + 8, arranged so that byte 0 holds (u0, u2), byte 1 (u1, u3), byte 2 (u4, u6),
byte 3 (u5, u7) (low nibble, high nibble). Pair j is the half2 (w_2j, w_2j+1), in input order:

    prmt.b32 t, word, 0x64646464, sel   bytes 0-1 (pairs 0, 1) or 2-3 (pairs 2, 3) of the word each
                                        become the low byte of an FP16 half whose high byte is
                                        0x64 (1024.0): (1024 + byte_a / 1024 ulp, ...)
    and.b32 t & 0x640F640F              low nibbles:  halves 1024 + u      (pairs 0, 2)
    and.b32 t & 0x64F064F0              high nibbles: halves 1024 + 16 u   (pairs 1, 3)
    fma.rn.f16x2 t, 1, -1032            (1024 + u) - 1032 = u - 8
    fma.rn.f16x2 t, 1/16, -72           (1024 + 16 u) / 16 - 72 = u - 8

Every step is exact in FP16 (the values are integers below 2048), so pair j is exactly
(w_2j, w_2j+1). Each step is written once (exponent_bytes, signed_pair). A kernel that needs all
four pairs (the GEMV, the mma.sync GEMM) calls unpack8: 2 prmt + 4 AND + 4 FMA per word, pairs 0
and 1 sharing one prmt. A wgmma lane, which needs only its pair t of each word, calls unpack_pair
with pair t's PAIR_CONSTANTS: 4 instructions per pair.
quant.unpack_prmt_reference is the numpy model of these steps.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..ptx.half2 import fma_f16x2
from ..ptx.prmt import prmt


def _half2(value: float) -> np.uint32:
    """The uint32 bits of the half2 (value, value)."""
    return np.array([value, value], dtype=np.float16).view(np.uint32)[0]


MAGIC_EXPONENTS = np.uint32(0x64646464)  # prmt pool bytes 4..7: FP16 high byte 0x64 = 1024.0
SELECT_BYTES_0_1 = np.uint32(0x4140)  # halves (0x64, byte 0), (0x64, byte 1): weights 0-3
SELECT_BYTES_2_3 = np.uint32(0x4342)  # halves (0x64, byte 2), (0x64, byte 3): weights 4-7
LOW_NIBBLES = np.uint32(0x640F640F)  # -> (1024 + u_a, 1024 + u_b)
HIGH_NIBBLES = np.uint32(0x64F064F0)  # -> (1024 + 16 u_a, 1024 + 16 u_b)
ONE = _half2(1.0)
MINUS_1032 = _half2(-1032.0)  # (1024 + u) - 1032 = u - 8, the signed weight
ONE_SIXTEENTH = _half2(1.0 / 16.0)
MINUS_72 = _half2(-72.0)  # (1024 + 16u) / 16 - 72 = u - 8

# (selector, mask, multiplier, offset) of pair j = weights 2j, 2j+1
PAIR_CONSTANTS = ((SELECT_BYTES_0_1, LOW_NIBBLES, ONE, MINUS_1032),
                  (SELECT_BYTES_0_1, HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72),
                  (SELECT_BYTES_2_3, LOW_NIBBLES, ONE, MINUS_1032),
                  (SELECT_BYTES_2_3, HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72))


@cuda.jit(device=True, inline="always")
def exponent_bytes(word, selector):
    """Step 1: two bytes of the word under FP16 exponents 0x64 (selector: bytes 0-1 or 2-3)."""
    return prmt(word, MAGIC_EXPONENTS, selector)


@cuda.jit(device=True, inline="always")
def signed_pair(halves, mask, multiplier, offset):
    """Steps 2 and 3: the low or high nibbles of exponent_bytes' halves, as the exact u - 8."""
    return fma_f16x2(halves & mask, multiplier, offset)


@cuda.jit(device=True, inline="always")
def unpack_pair(word, selector, mask, multiplier, offset):
    """The half2 (w_2j, w_2j+1) of a packed word, exactly, for pair j's PAIR_CONSTANTS."""
    return signed_pair(exponent_bytes(word, selector), mask, multiplier, offset)


@cuda.jit(device=True, inline="always")
def unpack8(word):
    """The four half2 (w0, w1), (w2, w3), (w4, w5), (w6, w7) of a packed word, exactly: pairs 0, 1
    share one prmt, pairs 2, 3 another."""
    low, high = exponent_bytes(word, SELECT_BYTES_0_1), exponent_bytes(word, SELECT_BYTES_2_3)
    return (signed_pair(low, LOW_NIBBLES, ONE, MINUS_1032), signed_pair(low, HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72),
            signed_pair(high, LOW_NIBBLES, ONE, MINUS_1032), signed_pair(high, HIGH_NIBBLES, ONE_SIXTEENTH, MINUS_72))
