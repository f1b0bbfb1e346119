"""`dp4a.s32.s32`: a four-way dot product of signed bytes, accumulated into an int32.

PTX ISA, Integer Arithmetic Instructions: dp4a. `dp4a.s32.s32 d, a, b, c` reads a and b as four
signed 8-bit lanes each and returns c + a0*b0 + a1*b1 + a2*b2 + a3*b3 (32-bit wrap-around). The
dp4a GEMV path feeds it INT4 weight nibbles (0..15, so the signed reading of each byte is the
nibble) against INT8-quantized activations: eight multiply-adds per two instructions.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def _signed_bytes(word):
    word = int(word) & 0xFFFFFFFF
    return [(word >> (8 * i) & 0xFF) - ((word >> (8 * i) & 0x80) << 1) for i in range(4)]


def dp4a_simulated(a, b, c):
    total = int(c) + sum(x * y for x, y in zip(_signed_bytes(a), _signed_bytes(b)))
    total &= 0xFFFFFFFF
    return total - (1 << 32) if total & 0x80000000 else total


@simulator_twin(dp4a_simulated)
@intrinsic
def dp4a(typingctx, a, b, c):
    """int32 c + dot(bytes of a, bytes of b), all bytes signed: `dp4a.s32.s32 d, a, b, c`."""
    if not all(isinstance(t, types.Integer) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        a32, b32 = (context.cast(builder, v, t, types.uint32) for v, t in zip(args[:2], sig.args[:2]))
        c32 = context.cast(builder, args[2], sig.args[2], types.int32)
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, [a32, b32, c32])

    return types.int32(a, b, c), codegen
