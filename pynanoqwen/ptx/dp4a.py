"""`dp4a`: a four-way dot product of bytes, accumulated into 32 bits.

PTX ISA, Integer Arithmetic Instructions: dp4a. `dp4a.atype.btype d, a, b, c` reads a and b as
four 8-bit lanes each, unsigned (.u32) or signed (.s32) per operand, and returns c + a0*b0 + a1*b1
+ a2*b2 + a3*b3 (32-bit wrap-around, so c and d may be read as int32 whatever the types). The
INT4 GEMV feeds it weight nibbles as bytes (0..15) against activation bytes:
- `dp4a` (.s32.s32): the dp4a path's INT8 activations;
- `dp4a_uu` (.u32.u32) and `dp4a_us` (.u32.s32): the fixed16 path's activations, 16-bit integers
  split into an unsigned low byte and a signed high byte (kernels/gemv_int4_paths.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def _bytes(word, signed: bool):
    word = int(word) & 0xFFFFFFFF
    lanes = [word >> (8 * i) & 0xFF for i in range(4)]
    return [v - 256 if signed and v & 0x80 else v for v in lanes]


def _dot_simulated(a, b, c, a_signed: bool, b_signed: bool) -> int:
    total = int(c) + sum(x * y for x, y in zip(_bytes(a, a_signed), _bytes(b, b_signed)))
    total &= 0xFFFFFFFF
    return total - (1 << 32) if total & 0x80000000 else total


def dp4a_simulated(a, b, c):
    return _dot_simulated(a, b, c, True, True)


def dp4a_uu_simulated(a, b, c):
    return _dot_simulated(a, b, c, False, False)


def dp4a_us_simulated(a, b, c):
    return _dot_simulated(a, b, c, False, True)


def _dp4a_intrinsic(instruction: str, doc: str):
    """The intrinsic `instruction d, a, b, c` for one signedness, documented by `doc`."""

    def dp4a_typed(typingctx, a, b, c):
        if not all(isinstance(t, types.Integer) for t in (a, b, c)):
            return None

        def codegen(context, builder, sig, args):
            a32, b32 = (context.cast(builder, v, t, types.uint32) for v, t in zip(args[:2], sig.args[:2]))
            c32 = context.cast(builder, args[2], sig.args[2], types.int32)
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), f"{instruction} $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, [a32, b32, c32])

        return types.int32(a, b, c), codegen

    dp4a_typed.__doc__ = doc
    return intrinsic(dp4a_typed)


dp4a = simulator_twin(dp4a_simulated)(_dp4a_intrinsic(
    "dp4a.s32.s32", "int32 c + dot(bytes of a, bytes of b), all bytes signed."))
dp4a_uu = simulator_twin(dp4a_uu_simulated)(_dp4a_intrinsic(
    "dp4a.u32.u32", "int32 c + dot(bytes of a, bytes of b), all bytes unsigned."))
dp4a_us = simulator_twin(dp4a_us_simulated)(_dp4a_intrinsic(
    "dp4a.u32.s32", "int32 c + dot(bytes of a unsigned, bytes of b signed)."))
