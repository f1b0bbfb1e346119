"""Programmatic dependent launch: a kernel may start before the one it depends on has finished.

PTX ISA, Parallel Synchronization and Communication Instructions: griddepcontrol (sm_90, PTX 7.8),
and the CUDA Programming Guide's "Programmatic Dependent Launch and Synchronization". A kernel
launched with the programmatic-stream-serialization attribute (pynanoqwen/launch.py) is allowed to
begin while the kernel before it in the stream still runs; inside a captured CUDA graph the edge
between the two becomes a programmatic edge. Two instructions make that safe and useful:

    grid_dependency_wait()   griddepcontrol.wait
        blocks the calling thread until every prerequisite grid has completed and its memory is
        visible. Every read of what an earlier kernel wrote, and every write an earlier kernel might
        still read, must come after it. Without a programmatic prerequisite it returns at once, so
        the same kernel is correct launched either way.
    launch_dependents()      griddepcontrol.launch_dependents
        this block lets the next kernel start: once every block of the grid has executed it (or
        exited), the dependent grid may be scheduled on whatever the SMs have free.

and one that lets the wait be spent usefully:

    prefetch_l2(array, index, nbytes)   cp.async.bulk.prefetch.L2.global [array + index], nbytes
        asks the copy engine to bring `nbytes` (a multiple of 16, 16-byte aligned) starting at
        element `index` of a 1-D global array into L2, without shared memory or registers (PTX ISA,
        Data Movement: cp.async.bulk.prefetch). A kernel's weights do not depend on the kernel
        before it, so they can be on their way before grid_dependency_wait returns.

The decode step's kernels each issue their weight loads, then launch_dependents, then
grid_dependency_wait, then read their inputs: the next kernel's weight stream starts while this
one's tail drains (docs/DECODE.md). Simulator twins: the simulator runs kernels one after another
and has no L2, so all three do nothing there.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .mbarrier import inline_ptx

ADDRSPACE_GLOBAL = 1  # NVVM's address space for global memory


def _nothing(*args):
    return None


@simulator_twin(_nothing)
@intrinsic
def grid_dependency_wait(typingctx):
    """Wait until the grids this one depends on have completed and their writes are visible:
    `griddepcontrol.wait`."""

    def codegen(context, builder, sig, args):
        inline_ptx(builder, "griddepcontrol.wait;", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(), codegen


@simulator_twin(_nothing)
@intrinsic
def launch_dependents(typingctx):
    """Allow the kernel launched after this one to start: `griddepcontrol.launch_dependents`."""

    def codegen(context, builder, sig, args):
        inline_ptx(builder, "griddepcontrol.launch_dependents;", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(), codegen


@simulator_twin(_nothing)
@intrinsic
def prefetch_l2(typingctx, array, index, nbytes):
    """Bring nbytes of a 1-D global array, from element `index` on, into L2:
    `cp.async.bulk.prefetch.L2.global [address], nbytes`. Both must be multiples of 16 bytes."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)
            and isinstance(nbytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array_type, index_type, nbytes_type = sig.args
        array_value, index_value, nbytes_value = args
        ary = context.make_array(array_type)(context, builder, value=array_value)
        index_value = context.cast(builder, index_value, index_type, types.intp)
        pointer = cgutils.get_item_pointer(context, builder, array_type, ary, [index_value], wraparound=False)
        global_pointer = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, ADDRSPACE_GLOBAL))
        address = builder.ptrtoint(global_pointer, ir.IntType(64))
        size = context.cast(builder, nbytes_value, nbytes_type, types.uint32)
        inline_ptx(builder, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}", [address, size])
        return context.get_dummy_value()

    return types.void(array, index, nbytes), codegen
