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
`syncthreads` but no shuffles. The twin gives every simulated warp an exchange: 32 slots and a
`threading.Barrier` for the warp's lanes. A shuffle writes its value into its lane's slot, waits
for the other lanes, reads its partner's slot, and waits again so no lane overwrites a slot that a
slower lane has still to read. Only the warp's own lanes synchronise, as on the GPU, so a kernel
whose warps diverge at block level (one warp reducing while others wait at `syncthreads`) runs
there as it does on hardware. A partner lane that does not exist (a partial last warp) is a bug the
GPU would hide as undefined data; the simulator raises instead.
"""

from __future__ import annotations

import threading

from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from . import simulator_twin

FULL_WARP = 0xFFFFFFFF


class _WarpExchange:
    """Slots and a barrier for the lanes of one simulated warp (simulator only)."""

    def __init__(self, lanes: int):
        self.slots = [None] * lanes
        # A lane that waits a minute is waiting for a lane that died (its exception is reported by
        # the simulator); breaking the barrier lets the waiting Python threads end too.
        self.barrier = threading.Barrier(lanes, timeout=60)


_exchanges_lock = threading.Lock()


def _warp_exchange(thread) -> _WarpExchange:
    """The exchange of the simulated warp `thread` belongs to; one set per simulated block."""
    block = thread._manager  # the simulator's BlockManager: a new one runs each block
    warp = thread.thread_id // 32
    with _exchanges_lock:
        exchanges = block.__dict__.setdefault("_pynanoqwen_warp_exchanges", {})
        if warp not in exchanges:
            threads_in_block = 1
            for extent in block._block_dim:
                threads_in_block *= extent
            exchanges[warp] = _WarpExchange(min(32, threads_in_block - 32 * warp))
        return exchanges[warp]


def shfl_xor_simulated(x, lane_mask):
    thread = threading.current_thread()
    exchange = _warp_exchange(thread)
    lane = thread.thread_id % 32
    partner = lane ^ int(lane_mask)
    if partner >= len(exchange.slots):
        raise RuntimeError(f"shfl_xor: lane {lane} reads lane {partner}, which this warp does not have")
    exchange.slots[lane] = x
    exchange.barrier.wait()
    value = exchange.slots[partner]
    exchange.barrier.wait()
    return value


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
    _warp_exchange(threading.current_thread()).barrier.wait()


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
