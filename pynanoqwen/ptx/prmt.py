"""`prmt.b32`: pick any four bytes out of two 32-bit registers in one instruction.

PTX ISA, Data Movement and Conversion Instructions: prmt. `prmt.b32 d, a, b, c` (default mode)
treats {b, a} as an 8-byte pool (a's bytes are 0-3, b's are 4-7); byte i of d is pool byte
c[4i+2 : 4i], or, when bit 4i+3 of the selector is set, that byte's sign bit copied into all
eight bits. The INT4 GEMV uses it to drop two weight bytes into the low bytes of two FP16 halves
whose high byte is 0x64 (see pynanoqwen/quant.py, ValueShuffle).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def prmt_simulated(a, b, selector):
    pool = int(a) & 0xFFFFFFFF | (int(b) & 0xFFFFFFFF) << 32
    selector = int(selector)
    result = 0
    for i in range(4):
        nibble = selector >> (4 * i) & 0xF
        byte = pool >> (8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        result |= byte << (8 * i)
    return result


@simulator_twin(prmt_simulated)
@intrinsic
def prmt(typingctx, a, b, selector):
    """uint32 made of four bytes chosen from the pool {b, a} by `selector`: `prmt.b32 d, a, b, c`."""
    if not all(isinstance(t, types.Integer) for t in (a, b, selector)):
        return None

    def codegen(context, builder, sig, args):
        a32, b32, sel32 = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args))
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, [a32, b32, sel32])

    return types.uint32(a, b, selector), codegen
