"""`mov.b32` between a float32 and a 32-bit integer register: the same 32 bits, read as the other type.

PTX ISA, Data Movement and Conversion Instructions: mov. Numba has no spelling for reinterpreting
a float's bits. The fixed16 GEMV path (kernels/gemv_int4_paths.py) keeps each activation chunk's
float32 scale in the same uint32 shared-memory array as its integer words, so it stores
float_bits(scale) and reads bits_float(word).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin


def float_bits_simulated(x):
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def bits_float_simulated(word):
    return np.array([int(word) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


@simulator_twin(float_bits_simulated)
@intrinsic
def float_bits(typingctx, x):
    """The uint32 bits of float32 x: `mov.b32 d, x`."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.FloatType()]), "mov.b32 $0, $1;", "=r,f")
        return builder.call(asm, list(args))

    return types.uint32(x), codegen


@simulator_twin(bits_float_simulated)
@intrinsic
def bits_float(typingctx, word):
    """The float32 whose bits are the 32-bit integer `word`: `mov.b32 d, word`."""
    if not isinstance(word, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word32 = context.cast(builder, args[0], sig.args[0], types.uint32)
        asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(32)]), "mov.b32 $0, $1;", "=f,r")
        return builder.call(asm, [word32])

    return types.float32(word), codegen
