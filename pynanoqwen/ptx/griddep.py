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

The decode step's GEMVs issue their first weight loads, then grid_dependency_wait, then read
their inputs, and signal launch_dependents once their last load is issued: the next kernel's
weight stream starts while this one's tail drains (docs/DECODE.md). Simulator twins: the simulator
runs kernels one after another, so both do nothing there.
"""

from __future__ import annotations

from numba import types
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .mbarrier import inline_ptx

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
