"""cp.async.bulk: one thread asks the copy engine (TMA) to move a contiguous block global -> shared.

`bulk_copy_to_shared(dst, src, nbytes, bars, i)` issues

    cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], nbytes, [bar];

(PTX ISA, Data Movement and Conversion Instructions: cp.async.bulk; sm_90, PTX 8.0). The issuing
thread goes on at once; the Tensor Memory Accelerator reads `nbytes` from global memory, writes them
to shared memory and then performs `complete_tx(nbytes)` on the mbarrier bars[i] (see mbarrier.py),
so a thread that waits on that barrier's phase sees the bytes. One instruction replaces the 256
threads x 16-byte loads and stores a copy loop would need, and no register holds the data on its
way. The `.shared::cluster` destination with our own CTA's shared address is the sm_90 spelling
(`.shared::cta` destinations need PTX 8.6); without clusters the two mean the same memory.

Rules the hardware enforces (violations are undefined behaviour, compute-sanitizer memcheck finds
some): `dst` and `src` 16-byte aligned, `nbytes` a positive multiple of 16, the barrier's phase
expecting those bytes (`mbarrier_arrive_expect_tx`) before it can complete. `dst` and `src` are
array views whose first element starts the copy (`k_ring[stage]`, `k_pages[page, kv_head]`);
declare shared destinations with `alignment=BULK_COPY_ALIGNMENT`, because Numba aligns a
`cuda.shared.array` only to its element size.

Simulator twin. The copy engine is modelled as a timer thread that lands the bytes a little later
(`SIMULATED_COPY_DELAY`) and then completes the transaction on the barrier. A kernel that reads a
stage before waiting for its barrier, or that refills a stage consumers are still reading, therefore
reads stale or half-old data in the simulator too, and its test fails. The twin also checks the
alignment, size and bounds rules above and raises where the GPU would silently misbehave.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from . import SIMULATOR, simulator_twin
from .mbarrier import barrier_address, complete_tx_simulated, inline_ptx, shared_address

ADDRSPACE_GLOBAL = 1  # NVVM's address space for global memory

BULK_COPY_ALIGNMENT = None if SIMULATOR else 128
"""`alignment=` for shared arrays that bulk copies write: 16 bytes is the rule, 128 keeps every
tile starting on a fresh row of the 32 shared-memory banks. The simulator rejects any alignment
argument; its numpy arrays are 16-byte aligned anyway (the twin checks)."""

SIMULATED_COPY_DELAY = 0.002  # seconds between issue and landing in the simulator


def _bytes_of(array, what: str) -> np.ndarray:
    """The bytes of a contiguous simulated array view (numpy, or the simulator's device wrapper)."""
    if not array.flags.c_contiguous:
        raise RuntimeError(f"cp.async.bulk: {what} must be a contiguous block of memory")
    flat = array.reshape(-1).view(np.uint8)
    if flat.ctypes.data % 16:
        raise RuntimeError(f"cp.async.bulk: {what} address {flat.ctypes.data:#x} is not 16-byte aligned")
    return flat


def bulk_copy_to_shared_simulated(dst, src, nbytes, bars, index):
    nbytes = int(nbytes)
    if nbytes <= 0 or nbytes % 16:
        raise RuntimeError(f"cp.async.bulk: size {nbytes} is not a positive multiple of 16")
    dst_bytes, src_bytes = _bytes_of(dst, "destination"), _bytes_of(src, "source")
    if nbytes > min(dst_bytes.size, src_bytes.size):
        raise RuntimeError(f"cp.async.bulk: {nbytes} bytes overrun the source ({src_bytes.size} B) "
                           f"or destination ({dst_bytes.size} B) view")
    data = src_bytes[:nbytes].copy()  # the engine reads global memory after the issue...

    def land():  # ...and the bytes appear in shared memory later, then the barrier hears of them
        dst_bytes[:nbytes] = data
        complete_tx_simulated(bars, index, nbytes)

    threading.Timer(SIMULATED_COPY_DELAY, land).start()


def _data_pointer(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, value=array).data


@simulator_twin(bulk_copy_to_shared_simulated)
@intrinsic
def bulk_copy_to_shared(typingctx, dst, src, nbytes, bars, index):
    """Copy `nbytes` from the start of global view `src` to the start of shared view `dst`;
    the copy engine signals completion as `nbytes` transaction bytes on barrier bars[index].

    One thread issues it. `nbytes` must be a multiple of 16, and both views 16-byte aligned.
    """
    arrays = isinstance(dst, types.Array) and isinstance(src, types.Array)
    barrier = (isinstance(bars, types.Array) and bars.ndim == 1 and bars.dtype == types.uint64
               and isinstance(index, types.Integer))
    if not (arrays and barrier and isinstance(nbytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        dst_type, src_type, nbytes_type, bars_type, index_type = sig.args
        dst_v, src_v, nbytes_v, bars_v, index_v = args
        dst_address = shared_address(context, builder, _data_pointer(context, builder, dst_type, dst_v))
        src_pointer = _data_pointer(context, builder, src_type, src_v)
        src_global = builder.addrspacecast(src_pointer,
                                           ir.PointerType(src_pointer.type.pointee, ADDRSPACE_GLOBAL))
        src_address = builder.ptrtoint(src_global, ir.IntType(64))
        size = context.cast(builder, nbytes_v, nbytes_type, types.uint32)
        bar_address = barrier_address(context, builder, bars_type, bars_v, index_type, index_v)
        inline_ptx(builder,
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
             "r,l,r,r,~{memory}", [dst_address, src_address, size, bar_address])
        return context.get_dummy_value()

    return types.void(dst, src, nbytes, bars, index), codegen
