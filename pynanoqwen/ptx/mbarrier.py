"""mbarrier: the shared-memory barrier that Hopper's asynchronous bulk copies complete on.

An mbarrier is an opaque 64-bit object in shared memory (PTX ISA, Parallel Synchronization and
Communication Instructions: mbarrier). For its current phase it counts two things:

- pending arrivals: threads that still have to call `mbarrier_arrive` (or `..._expect_tx`);
- the transaction count: bytes that asynchronous copies (`cp.async.bulk`, see bulk_copy.py) have
  been announced to deliver (`expect_tx`) but have not delivered yet (`complete_tx`).

When both reach zero the phase completes: the barrier's phase parity flips, the arrival count is
re-armed with the count given to `mbarrier_init`, and a thread waiting for that phase may read
everything the phase tracked, including the bytes the copy engine wrote into shared memory.
Waiting is by parity: `mbarrier_try_wait_parity(bars, i, parity)` is true once the phase whose
parity is `parity` has completed, i.e. while the barrier's current parity differs from it.

The instructions here, each one inline-PTX intrinsic, all on a barrier named as (array, index):

    mbarrier_init(bars, i, count)            mbarrier.init.shared::cta.b64
    fence_barrier_init()                     fence.proxy.async.shared::cta
    mbarrier_arrive(bars, i)                 mbarrier.arrive.shared::cta.b64
    mbarrier_arrive_expect_tx(bars, i, n)    mbarrier.arrive.expect_tx.shared::cta.b64
    mbarrier_try_wait_parity(bars, i, p)     mbarrier.try_wait.parity.shared::cta.b64
    mbarrier_wait(bars, i, p)                the try_wait loop (a device function)

`bars` is a `cuda.shared.array(n, types.uint64)`; the PTX operand is its 32-bit shared-window
address. Numba lowers `cuda.shared.array` to a global in LLVM address space 3 and hands the kernel
a generic pointer (an `addrspacecast` of it); `shared_address` casts that pointer back to address
space 3 and takes its 32-bit integer value. NVVM folds the two casts away: the PTX is
`mov.u64 %rd, _cudapy_smem_N` (the array's offset in the shared window) plus the element offset,
truncated with `cvt.u32.u64`; no `cvta` instruction.

Simulator twin (NUMBA_ENABLE_CUDASIM=1). The twins keep the barrier's state where the hardware
keeps it, in the uint64 word itself, so a barrier re-initialised by the next simulated block
starts afresh exactly as it does on the GPU. The word packs (our layout, not the hardware's):

    bits  0..19  pending arrivals          bits 40..62  tx-count + 2**22 (it may go negative)
    bits 20..39  expected arrivals         bit  63      phase parity

Updates happen under one lock; waiters sleep on a condition variable that every phase completion
notifies, so a simulated try_wait blocks like the hardware one (which suspends the thread for a
while) instead of spinning. Arriving more times than the barrier expects, or a tx-count outside
the hardware range of +-(2**20 - 1), raises: on the GPU that is undefined behaviour. A wait that
no phase completion satisfies within a minute raises too: on the GPU it would hang forever.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .rendezvous import wait_for

ADDRSPACE_SHARED = 3  # NVVM's address space for __shared__ memory
MAX_COUNT = 2**20 - 1  # largest arrival count and tx-count an mbarrier holds (PTX ISA, mbarrier)


def _barrier_operands(bars, index) -> bool:
    """Typing check shared by the intrinsics: a 1-D uint64 array and an integer index."""
    return (isinstance(bars, types.Array) and bars.ndim == 1 and bars.dtype == types.uint64
            and isinstance(index, types.Integer))


def shared_address(context, builder, pointer):
    """The 32-bit shared-window address of a generic pointer into `cuda.shared.array` memory."""
    shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, ADDRSPACE_SHARED))
    return builder.ptrtoint(shared, ir.IntType(32))


def barrier_address(context, builder, bars_type, bars, index_type, index):
    """Shared address of `bars[index]` (no negative-index wraparound: the index is ours)."""
    index = context.cast(builder, index, index_type, types.intp)
    array = context.make_array(bars_type)(context, builder, value=bars)
    pointer = cgutils.get_item_pointer(context, builder, bars_type, array, [index], wraparound=False)
    return shared_address(context, builder, pointer)


def inline_ptx(builder, text, constraints, operands, result=ir.VoidType()):
    """Call one inline-PTX statement with side effects (it must stay where the kernel put it)."""
    fn_type = ir.FunctionType(result, [op.type for op in operands])
    return builder.call(ir.InlineAsm(fn_type, text, constraints, side_effect=True), operands)


# --- Simulator twins ------------------------------------------------------------------------

_state_changed = threading.Condition()
_TX_BIAS = 2**22


def _unpack(word) -> tuple[int, int, int, int]:
    word = int(word)
    return (word & 0xFFFFF, (word >> 20) & 0xFFFFF, ((word >> 40) & 0x7FFFFF) - _TX_BIAS, word >> 63)


def _pack(pending: int, expected: int, tx: int, parity: int) -> np.uint64:
    return np.uint64((parity << 63) | ((tx + _TX_BIAS) << 40) | (expected << 20) | pending)


def _update(bars, index, arrivals: int, tx_delta: int) -> None:
    """Arrive `arrivals` times and add `tx_delta` to the tx-count; complete the phase if done."""
    with _state_changed:
        pending, expected, tx, parity = _unpack(bars[index])
        if expected == 0:
            raise RuntimeError(f"mbarrier {index}: used before mbarrier_init")
        pending -= arrivals
        tx += tx_delta
        if pending < 0:
            raise RuntimeError(f"mbarrier {index}: more arrivals than the {expected} it expects")
        if abs(tx) > MAX_COUNT:
            raise RuntimeError(f"mbarrier {index}: tx-count {tx} outside +-{MAX_COUNT}")
        if pending == 0 and tx == 0:
            pending, parity = expected, parity ^ 1
            _state_changed.notify_all()
        bars[index] = _pack(pending, expected, tx, parity)


def mbarrier_init_simulated(bars, index, count):
    if not 1 <= count <= MAX_COUNT:
        raise RuntimeError(f"mbarrier_init: count {count} outside 1..{MAX_COUNT}")
    with _state_changed:
        bars[index] = _pack(int(count), int(count), 0, 0)


def fence_barrier_init_simulated():
    """The simulated copy engine reads the barrier through the same Python object: nothing to do."""


def mbarrier_arrive_simulated(bars, index):
    _update(bars, index, 1, 0)


def mbarrier_arrive_expect_tx_simulated(bars, index, tx_bytes):
    _update(bars, index, 1, int(tx_bytes))


def complete_tx_simulated(bars, index, tx_bytes) -> None:
    """What the copy engine does when a bulk copy's bytes have landed (bulk_copy.py's twin)."""
    _update(bars, index, 0, -int(tx_bytes))


def mbarrier_try_wait_parity_simulated(bars, index, parity):
    """Returns once the phase has completed: a try_wait whose time limit never runs out early."""

    def phase_done():
        return _unpack(bars[index])[3] != (int(parity) & 1)

    with _state_changed:
        wait_for(_state_changed, phase_done, lambda: f"mbarrier {index}: phase with parity {parity} never completed")
    return True


# --- The intrinsics ----------------------------------------------------------------------------

@simulator_twin(mbarrier_init_simulated)
@intrinsic
def mbarrier_init(typingctx, bars, index, count):
    """Arm barrier bars[index] for `count` arrivals per phase, phase 0, tx-count 0.

    `mbarrier.init.shared::cta.b64 [addr], count;`. One thread initialises; make the result
    visible with `fence_barrier_init()` and `cuda.syncthreads()` before anyone else uses it.
    """
    if not (_barrier_operands(bars, index) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        address = barrier_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        count = context.cast(builder, args[2], sig.args[2], types.uint32)
        inline_ptx(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", [address, count])
        return context.get_dummy_value()

    return types.void(bars, index, count), codegen


@simulator_twin(fence_barrier_init_simulated)
@intrinsic
def fence_barrier_init(typingctx):
    """Order the mbarrier.init writes before any use of the barriers by the async proxy.

    `fence.proxy.async.shared::cta;`. mbarrier.init is an ordinary (generic-proxy) write; the copy
    engine that signals the barrier through complete_tx works in the async proxy, which sees
    generic writes only after this fence (PTX ISA, Memory Consistency Model: proxies).
    """

    def codegen(context, builder, sig, args):
        inline_ptx(builder, "fence.proxy.async.shared::cta;", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(), codegen


@simulator_twin(mbarrier_arrive_simulated)
@intrinsic
def mbarrier_arrive(typingctx, bars, index):
    """Count one arrival of this thread on bars[index] (release: its earlier accesses happen first).

    `mbarrier.arrive.shared::cta.b64 _, [addr];`: the state the instruction returns is discarded,
    we wait by parity instead.
    """
    if not _barrier_operands(bars, index):
        return None

    def codegen(context, builder, sig, args):
        address = barrier_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        inline_ptx(builder, "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}", [address])
        return context.get_dummy_value()

    return types.void(bars, index), codegen


@simulator_twin(mbarrier_arrive_expect_tx_simulated)
@intrinsic
def mbarrier_arrive_expect_tx(typingctx, bars, index, tx_bytes):
    """Announce `tx_bytes` more bytes for this phase of bars[index], then arrive once.

    `mbarrier.arrive.expect_tx.shared::cta.b64 _, [addr], tx_bytes;`. The producer calls it before
    issuing the copies that will deliver exactly those bytes, so the phase cannot complete until
    they have all landed.
    """
    if not (_barrier_operands(bars, index) and isinstance(tx_bytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        address = barrier_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        nbytes = context.cast(builder, args[2], sig.args[2], types.uint32)
        inline_ptx(builder, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}",
             [address, nbytes])
        return context.get_dummy_value()

    return types.void(bars, index, tx_bytes), codegen


@simulator_twin(mbarrier_try_wait_parity_simulated)
@intrinsic
def mbarrier_try_wait_parity(typingctx, bars, index, parity):
    """True once the phase of bars[index] with parity `parity` (0 or 1) has completed.

    `mbarrier.try_wait.parity.shared::cta.b64 p, [addr], parity;` (acquire: what the phase tracked
    is visible afterwards). The hardware suspends the thread for a while before answering false,
    so a loop around it (`mbarrier_wait`) does not hammer the barrier.
    """
    if not (_barrier_operands(bars, index) and isinstance(parity, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        address = barrier_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        parity = context.cast(builder, args[2], sig.args[2], types.uint32)
        done = inline_ptx(builder,
                    "{ .reg .pred done; "
                    "mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                    "selp.u32 $0, 1, 0, done; }",
                    "=r,r,r,~{memory}", [address, parity], ir.IntType(32))
        return builder.icmp_unsigned("!=", done, ir.Constant(ir.IntType(32), 0))

    return types.boolean(bars, index, parity), codegen


@cuda.jit(device=True, inline="always")
def mbarrier_wait(bars, index, parity):
    """Block until the phase of bars[index] with parity `parity` has completed."""
    while not mbarrier_try_wait_parity(bars, index, parity):
        pass
