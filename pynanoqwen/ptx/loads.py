"""16-byte global loads: `ld.global.nc.v4.u32` through the read-only (non-coherent) data path, and
`ld.global.cg.v4.f32` through L2 only (for what other blocks of the running kernel wrote).

PTX ISA, Data Movement and Conversion Instructions: ld.global.nc. One instruction moves four
consecutive 32-bit words; a warp of 32 lanes reading consecutive 16-byte chunks moves 512 bytes
with four fully used 128-byte transactions. On the H200 this reached 4.33 TB/s against 3.6 TB/s
with 4-byte loads (docs/PERFORMANCE.md). `.nc` promises the data is not written while the
kernel runs, which is true of weights and of an activation vector a previous kernel produced.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import simulator_twin

_QUAD = types.UniTuple(types.uint32, 4)


def ld_global_nc_v4_u32_simulated(array, index):
    index = int(index)
    if index % 4:
        raise RuntimeError(f"ld_global_nc_v4_u32: word index {index} is not 16-byte aligned")
    return (array[index], array[index + 1], array[index + 2], array[index + 3])


@simulator_twin(ld_global_nc_v4_u32_simulated)
@intrinsic
def ld_global_nc_v4_u32(typingctx, array, index):
    """(array[index], ..., array[index + 3]) of a 1-D uint32 array, as one 16-byte load.

    `index` must be a multiple of 4 (the load is 16-byte aligned); no bounds check, as on any
    GPU load. `ld.global.nc.v4.u32 {d0, d1, d2, d3}, [address]`.
    """
    if not (isinstance(array, types.Array) and array.dtype == types.uint32 and array.ndim == 1
            and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array_type, index_type = sig.args
        array_value, index_value = args
        ary = context.make_array(array_type)(context, builder, value=array_value)
        index_value = context.cast(builder, index_value, index_type, types.intp)
        address = cgutils.get_item_pointer(context, builder, array_type, ary, [index_value])
        i32 = ir.IntType(32)
        quad = ir.LiteralStructType([i32, i32, i32, i32])
        asm = ir.InlineAsm(ir.FunctionType(quad, [address.type]),
                           "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
        loaded = builder.call(asm, [address])
        words = [builder.extract_value(loaded, i) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, words)

    return _QUAD(array, index), codegen


_FLOAT4 = types.UniTuple(types.float32, 4)


def ld_global_cg_v4_f32_simulated(array, index):
    index = int(index)
    if index % 4:
        raise RuntimeError(f"ld_global_cg_v4_f32: index {index} is not 16-byte aligned")
    return tuple(float(array[index + i]) for i in range(4))


@simulator_twin(ld_global_cg_v4_f32_simulated)
@intrinsic
def ld_global_cg_v4_f32(typingctx, array, index):
    """(array[index], ..., array[index + 3]) of a 1-D float32 array, one 16-byte load cached in L2
    only: `ld.global.cg.v4.f32`. For data other blocks of the same kernel wrote (and fenced), which
    the read-only `.nc` path and L1 may not see. `index` must be a multiple of 4."""
    if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 1
            and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array_type, index_type = sig.args
        array_value, index_value = args
        ary = context.make_array(array_type)(context, builder, value=array_value)
        index_value = context.cast(builder, index_value, index_type, types.intp)
        address = cgutils.get_item_pointer(context, builder, array_type, ary, [index_value])
        f32 = ir.FloatType()
        quad = ir.LiteralStructType([f32, f32, f32, f32])
        asm = ir.InlineAsm(ir.FunctionType(quad, [address.type]),
                           "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l,~{memory}",
                           side_effect=True)
        loaded = builder.call(asm, [address])
        values = [builder.extract_value(loaded, i) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, values)

    return _FLOAT4(array, index), codegen


def ld_global_cg_f32_simulated(array, index):
    return float(array[int(index)])


@simulator_twin(ld_global_cg_f32_simulated)
@intrinsic
def ld_global_cg_f32(typingctx, array, index):
    """array[index] of a 1-D float32 array, cached in L2 only: `ld.global.cg.f32` (see
    ld_global_cg_v4_f32)."""
    if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 1
            and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array_type, index_type = sig.args
        array_value, index_value = args
        ary = context.make_array(array_type)(context, builder, value=array_value)
        index_value = context.cast(builder, index_value, index_type, types.intp)
        address = cgutils.get_item_pointer(context, builder, array_type, ary, [index_value])
        asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [address.type]), "ld.global.cg.f32 $0, [$1];",
                           "=f,l,~{memory}", side_effect=True)
        return builder.call(asm, [address])

    return types.float32(array, index), codegen
