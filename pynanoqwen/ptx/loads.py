"""16-byte global loads: `ld.global.nc.v4.u32` through the read-only (non-coherent) data path, and
`ld.global.cg.v4.f32` through L2 only (for what other blocks of the running kernel wrote); and
the 16-byte store `st.global.v4.f32`.

PTX ISA, Data Movement and Conversion Instructions: ld.global.nc. One instruction moves four
consecutive 32-bit words; a warp of 32 lanes reading consecutive 16-byte chunks moves 512 bytes
with four fully used 128-byte transactions. On the H200 this reached 4.33 TB/s against 3.6 TB/s
with 4-byte loads (docs/HARDWARE.md). `.nc` promises the data is not written while the
kernel runs, which is true of weights and of an activation vector a previous kernel produced.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import simulator_twin

def _element_address(context, builder, sig, args):
    """The address of array[index] for an intrinsic called as (array, index)."""
    array_type, index_type = sig.args
    ary = context.make_array(array_type)(context, builder, value=args[0])
    index = context.cast(builder, args[1], index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index])


def _load(instruction: str, register: str, llvm_type, count: int, side_effect: bool):
    """codegen of one `count`-wide load instruction: its values as a tuple (or one value)."""

    def codegen(context, builder, sig, args):
        address = _element_address(context, builder, sig, args)
        outputs = ", ".join(f"${i}" for i in range(count))
        result = llvm_type if count == 1 else ir.LiteralStructType([llvm_type] * count)
        text = f"{instruction} {{{outputs}}}, [${count}];" if count > 1 else f"{instruction} $0, [$1];"
        constraints = ",".join([f"={register}"] * count + ["l"] + (["~{memory}"] if side_effect else []))
        loaded = builder.call(ir.InlineAsm(ir.FunctionType(result, [address.type]), text, constraints,
                                           side_effect=side_effect), [address])
        if count == 1:
            return loaded
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, i) for i in range(count)])

    return codegen


def _is_vector(array, dtype, index) -> bool:
    return (isinstance(array, types.Array) and array.dtype == dtype and array.ndim == 1
            and isinstance(index, types.Integer))


def _aligned(name: str, index) -> int:
    index = int(index)
    if index % 4:
        raise RuntimeError(f"{name}: index {index} is not 16-byte aligned")
    return index


def ld_global_nc_v4_u32_simulated(array, index):
    index = _aligned("ld_global_nc_v4_u32", index)
    return (array[index], array[index + 1], array[index + 2], array[index + 3])


@simulator_twin(ld_global_nc_v4_u32_simulated)
@intrinsic
def ld_global_nc_v4_u32(typingctx, array, index):
    """(array[index], ..., array[index + 3]) of a 1-D uint32 array, as one 16-byte load.

    `index` must be a multiple of 4 (the load is 16-byte aligned); no bounds check, as on any
    GPU load. `ld.global.nc.v4.u32 {d0, d1, d2, d3}, [address]`.
    """
    if not _is_vector(array, types.uint32, index):
        return None
    return types.UniTuple(types.uint32, 4)(array, index), _load("ld.global.nc.v4.u32", "r", ir.IntType(32), 4, False)


def ld_global_cg_v4_f32_simulated(array, index):
    index = _aligned("ld_global_cg_v4_f32", index)
    return tuple(float(array[index + i]) for i in range(4))


@simulator_twin(ld_global_cg_v4_f32_simulated)
@intrinsic
def ld_global_cg_v4_f32(typingctx, array, index):
    """(array[index], ..., array[index + 3]) of a 1-D float32 array, one 16-byte load cached in L2
    only: `ld.global.cg.v4.f32`. For data other blocks of the same kernel wrote (and fenced), which
    the read-only `.nc` path and L1 may not see. `index` must be a multiple of 4. Marked as having
    side effects, so that it stays after the fence and atomic that publish the data."""
    if not _is_vector(array, types.float32, index):
        return None
    return types.UniTuple(types.float32, 4)(array, index), _load("ld.global.cg.v4.f32", "f", ir.FloatType(), 4, True)


def ld_global_cg_f32_simulated(array, index):
    return float(array[int(index)])


@simulator_twin(ld_global_cg_f32_simulated)
@intrinsic
def ld_global_cg_f32(typingctx, array, index):
    """array[index] of a 1-D float32 array, cached in L2 only: `ld.global.cg.f32` (see
    ld_global_cg_v4_f32)."""
    if not _is_vector(array, types.float32, index):
        return None
    return types.float32(array, index), _load("ld.global.cg.f32", "f", ir.FloatType(), 1, True)


def st_global_v4_f32_simulated(array, index, a, b, c, d):
    index = _aligned("st_global_v4_f32", index)
    array[index], array[index + 1], array[index + 2], array[index + 3] = a, b, c, d


@simulator_twin(st_global_v4_f32_simulated)
@intrinsic
def st_global_v4_f32(typingctx, array, index, a, b, c, d):
    """array[index .. index + 3] = a, b, c, d for a 1-D float32 array, one 16-byte store:
    `st.global.v4.f32 [address], {a, b, c, d}`. `index` must be a multiple of 4. Marked as having
    side effects (a memory clobber), so loads written after it stay after it and loads written
    before it stay before it: a caller can put several loads in flight before their stores."""
    if not _is_vector(array, types.float32, index) or not all(isinstance(v, types.Float) for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        address = _element_address(context, builder, types.float32(*sig.args[:2]), args[:2])
        values = [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:], sig.args[2:])]
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [address.type] + [ir.FloatType()] * 4),
                                  "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}",
                                  side_effect=True), [address] + values)
        return context.get_dummy_value()

    return types.void(array, index, a, b, c, d), codegen
