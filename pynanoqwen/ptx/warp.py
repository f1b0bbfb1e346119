"""Warp shuffles and the warp-wide reductions built on them.

`shfl_xor(x, lane_mask)` is PTX `shfl.sync.bfly.b32` with all 32 lanes taking part (PTX ISA, Data
Movement and Conversion Instructions: shfl.sync): lane L receives the value that lane L ^ lane_mask
passed in. `warp_sum` and `warp_max` fold a float32 across the warp with five butterfly steps
(masks 16, 8, 4, 2, 1); afterwards every lane holds the result. Because a + b == b + a in IEEE
arithmetic, partner lanes compute identical values at every step, so all 32 lanes end with the
same bits, and the simulator reproduces them exactly.

Contract, on the GPU and in the simulator alike: all 32 lanes of the warp call the shuffle together
(full member mask 0xffffffff), so call these from warp-uniform control flow only.

Simulator design. numba-cuda's simulator runs each CUDA thread as a Python thread and has
`syncthreads` but no shuffles. A shuffle's lanes meet at their warp's rendezvous (rendezvous.py):
each deposits its value and lane mask, the last to arrive hands every lane its partner's value.
Only the warp's own lanes synchronise, as on the GPU, so a kernel whose warps diverge at block level
(one warp reducing while others wait at `syncthreads`) runs there as it does on hardware. A partner
lane that does not exist (a partial last warp) is a bug the GPU would hide as undefined data; the
simulator raises instead.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .rendezvous import cooperate

FULL_WARP = 0xFFFFFFFF


def _exchange(lanes: list) -> list:
    """What shfl.sync.bfly hands each lane: lanes[L] = (value, lane_mask) of lane L."""
    received = []
    for lane, (_, lane_mask) in enumerate(lanes):
        partner = lane ^ int(lane_mask)
        if partner >= len(lanes):
            raise RuntimeError(f"shfl_xor: lane {lane} reads lane {partner}, which this warp does not have")
        received.append(lanes[partner][0])
    return received


def shfl_xor_simulated(x, lane_mask):
    return cooperate("shfl.sync.bfly", (x, lane_mask), _exchange, partial=True)


_SHFL_REGISTER = {types.float32: "f", types.int32: "r", types.uint32: "r"}


@simulator_twin(shfl_xor_simulated)
@intrinsic
def shfl_xor(typingctx, x, lane_mask):
    """x from lane (laneid ^ lane_mask): `shfl.sync.bfly.b32 d, x, lane_mask, 0x1f, 0xffffffff`.

    x is float32, int32 or uint32 (any 32-bit value; the shuffle moves bits). All 32 lanes call it.
    """
    if x not in _SHFL_REGISTER or not isinstance(lane_mask, types.Integer):
        return None
    reg = _SHFL_REGISTER[x]

    def codegen(context, builder, sig, args):
        value, mask = args
        mask = context.cast(builder, mask, sig.args[1], types.uint32)
        llvm_type = context.get_value_type(x)
        fn_type = ir.FunctionType(llvm_type, [llvm_type, ir.IntType(32)])
        # Side effects on: a shuffle must not be moved into divergent code or merged away.
        asm = ir.InlineAsm(fn_type, "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                           f"={reg},{reg},r", side_effect=True)
        return builder.call(asm, [value, mask])

    return x(x, lane_mask), codegen


@cuda.jit(device=True, inline="always")
def warp_sum(x):
    """Sum of float32 x over the 32 lanes of the warp, returned to every lane."""
    x += shfl_xor(x, 16)
    x += shfl_xor(x, 8)
    x += shfl_xor(x, 4)
    x += shfl_xor(x, 2)
    x += shfl_xor(x, 1)
    return x


@cuda.jit(device=True, inline="always")
def warp_max(x):
    """Maximum of float32 x over the 32 lanes of the warp, returned to every lane."""
    x = max(x, shfl_xor(x, 16))
    x = max(x, shfl_xor(x, 8))
    x = max(x, shfl_xor(x, 4))
    x = max(x, shfl_xor(x, 2))
    x = max(x, shfl_xor(x, 1))
    return x


def syncwarp_simulated():
    cooperate("bar.warp.sync", None, lambda lanes: [None] * len(lanes), partial=True)


@simulator_twin(syncwarp_simulated)
@intrinsic
def syncwarp(typingctx):
    """Barrier and memory fence among the 32 lanes of this warp: `bar.warp.sync 0xffffffff` (PTX ISA,
    Parallel Synchronization: bar.warp.sync). Shared-memory writes a lane made before it are seen
    by the warp's other lanes after it. All 32 lanes call it."""

    def codegen(context, builder, sig, args):
        fn_type = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fn_type, "bar.warp.sync 0xffffffff;", "~{memory}", side_effect=True), [])
        return context.get_dummy_value()

    return types.void(), codegen
