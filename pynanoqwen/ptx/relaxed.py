"""GPU-scope relaxed 16-byte loads and stores, for words that blocks of one running kernel hand
each other with no fence or counter, and the float32 <-> bits moves that test such a word.

PTX ISA, Memory Consistency Model (relaxed operations, scope) and Data Movement: ld, st.
`ld.relaxed.gpu.global.v4.u32` and `st.relaxed.gpu.global.v4.u32` are strong operations at GPU
scope: a relaxed load by one block that races with a relaxed store by another is defined (it
returns the old word or the new one, never a mix of a word's bytes), and it reads the L2-coherent
value, not a stale L1 line. Each of the four words is its own memory operation: a reader may see
some words of a vector store and not others, so it tests every word it needs. Relaxed operations
order nothing else; the one protocol built on them (kernels/attention_decode.py's split records)
needs no order, because each word it reads is either the value its writer computed or the
UNWRITTEN pattern that no float32 arithmetic produces (PTX returns the canonical NaN,
0x7FFFFFFF, from any operation whose result is NaN).

    ld_relaxed_gpu_v4_u32(words, i)            -> (words[i], ..., words[i + 3])
    st_relaxed_gpu_v4_u32(words, i, a, b, c, d)   words[i:i + 4] = a, b, c, d
    f32_bits(x)        the uint32 pattern of float32 x (an LLVM bitcast: no instruction)
    f32_from_bits(w)   the float32 whose pattern is w

`i` must be a multiple of 4 (16-byte aligned); no bounds check, as on any GPU access. Both
memory instructions are marked as having side effects, so a polling loop reloads every time.
Simulator twins: numpy reads and writes (the simulator runs blocks one after another).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .loads import _aligned, _element_address, _is_vector, _load

UNWRITTEN = 0xFFFFFFFF  # a NaN pattern with its sign and every payload bit set: never a result


def ld_relaxed_gpu_v4_u32_simulated(words, index):
    index = _aligned("ld_relaxed_gpu_v4_u32", index)
    return tuple(np.uint32(words[index + i]) for i in range(4))


@simulator_twin(ld_relaxed_gpu_v4_u32_simulated)
@intrinsic
def ld_relaxed_gpu_v4_u32(typingctx, words, index):
    """(words[index], ..., words[index + 3]) of a 1-D uint32 array: `ld.relaxed.gpu.global.v4.u32`."""
    if not _is_vector(words, types.uint32, index):
        return None
    return (types.UniTuple(types.uint32, 4)(words, index),
            _load("ld.relaxed.gpu.global.v4.u32", "r", ir.IntType(32), 4, True))


def st_relaxed_gpu_v4_u32_simulated(words, index, a, b, c, d):
    index = _aligned("st_relaxed_gpu_v4_u32", index)
    words[index:index + 4] = (a, b, c, d)


@simulator_twin(st_relaxed_gpu_v4_u32_simulated)
@intrinsic
def st_relaxed_gpu_v4_u32(typingctx, words, index, a, b, c, d):
    """words[index:index + 4] = (a, b, c, d) of a 1-D uint32 array: `st.relaxed.gpu.global.v4.u32`."""
    if not _is_vector(words, types.uint32, index) or any(v != types.uint32 for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        address = _element_address(context, builder, sig.replace(args=sig.args[:2]), args[:2])
        function = ir.FunctionType(ir.VoidType(), [address.type] + [ir.IntType(32)] * 4)
        builder.call(ir.InlineAsm(function, "st.relaxed.gpu.global.v4.u32 [$0], {$1, $2, $3, $4};",
                                  "l,r,r,r,r,~{memory}", side_effect=True), [address] + list(args[2:]))
        return context.get_dummy_value()

    return types.void(words, index, a, b, c, d), codegen


def f32_bits_simulated(x):
    return np.float32(x).view(np.uint32)


@simulator_twin(f32_bits_simulated)
@intrinsic
def f32_bits(typingctx, x):
    """The uint32 bit pattern of float32 x."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


def f32_from_bits_simulated(w):
    return np.uint32(w).view(np.float32)


@simulator_twin(f32_from_bits_simulated)
@intrinsic
def f32_from_bits(typingctx, w):
    """The float32 whose bit pattern is uint32 w."""
    if w != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(w), codegen
