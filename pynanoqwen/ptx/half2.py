"""Packed half2 arithmetic on uint32 registers: `fma.rn.f16x2` and half2 -> two float32.

numba-cuda 0.30 has scalar float16 math (`numba.cuda.fp16.hfma`) but no half2 type, and one
`fma.rn.f16x2` does two FP16 multiply-adds in one instruction. So a half2 travels as the uint32
that holds its bits (low half = element 0, as in memory), and these two intrinsics work on it:

- `fma_f16x2(a, b, c)`: element-wise a * b + c, each rounded once to nearest even.
  PTX ISA, Half Precision Floating-Point Instructions: fma (`fma.rn.f16x2`).
- `half2_to_float2(h)`: the two halves as float32 (exact). PTX ISA, Data Movement and Conversion
  Instructions: mov (unpack a .b32 into two .f16) and cvt (`cvt.f32.f16`).
- `float2_to_half2(lo, hi)`: two float32 rounded to nearest even into one half2 (lo = element 0).
  PTX ISA, Data Movement and Conversion Instructions: cvt (`cvt.rn.f16x2.f32 d, a, b` puts a in
  the upper half and b in the lower one).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def _halves(word) -> tuple[np.float16, np.float16]:
    pair = np.array([int(word) & 0xFFFFFFFF], dtype=np.uint32).view(np.float16)
    return pair[0], pair[1]


def _word(lo: np.float16, hi: np.float16) -> int:
    return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


def _fma_f16(a: np.float16, b: np.float16, c: np.float16) -> np.float16:
    """a * b + c rounded once to FP16 (round to nearest even), like `fma.rn.f16`.

    Computing a * b + c in float64 and rounding that to FP16 is one correct rounding, not a double
    one: the product of two FP16 values has at most 22 significant bits, so it is exact in float64,
    and FP16 values are multiples of 2^-24 below 2^16, so the sum is exact in float64 as well except
    (1) when |a b| >= 2^17, where both results overflow to infinity, and (2) when |a b| < 2^-29 |c|,
    where the exact value lies far inside half an FP16 step of c and both roundings return c.
    """
    return np.float16(np.float64(a) * np.float64(b) + np.float64(c))


def fma_f16x2_simulated(a, b, c):
    return _word(*(_fma_f16(x, y, z) for x, y, z in zip(_halves(a), _halves(b), _halves(c))))


def float2_to_half2_simulated(lo, hi):
    return _word(np.float16(lo), np.float16(hi))


def half2_to_float2_simulated(h):
    lo, hi = _halves(h)
    return np.float32(lo), np.float32(hi)


@simulator_twin(fma_f16x2_simulated)
@intrinsic
def fma_f16x2(typingctx, a, b, c):
    """Packed half2 a * b + c (uint32 bit patterns in and out): `fma.rn.f16x2 d, a, b, c`."""
    if not all(isinstance(t, types.Integer) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, words)

    return types.uint32(a, b, c), codegen


_FLOAT2 = types.UniTuple(types.float32, 2)


@simulator_twin(half2_to_float2_simulated)
@intrinsic
def half2_to_float2(typingctx, h):
    """(float32(low half), float32(high half)) of the half2 held in uint32 h."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        f32 = ir.FloatType()
        pair = ir.LiteralStructType([f32, f32])
        asm = ir.InlineAsm(ir.FunctionType(pair, [ir.IntType(32)]),
                           "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                           "=f,=f,r")
        unpacked = builder.call(asm, [word])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(unpacked, i) for i in range(2)])

    return _FLOAT2(h), codegen


@simulator_twin(float2_to_half2_simulated)
@intrinsic
def float2_to_half2(typingctx, lo, hi):
    """The uint32 bits of the half2 (float16(lo), float16(hi)), each rounded to nearest even."""
    if not (lo == types.float32 and hi == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
        return builder.call(asm, list(args))

    return types.uint32(lo, hi), codegen
