"""cp.async.bulk.tensor: one thread asks the copy engine (TMA) for a 2-D box of a tensor in global
memory, described by a tensor map, and the engine writes it to shared memory, swizzled if the map
says so. The prefill GEMM's feed (kernels/gemm_int4_tma.py).

    tensor_map(array, box_inner, box_rows, swizzle, rows=None)   # host: the map, on the device
    acquire_tensor_map(tmap)                                     # device: before the first copy
    tensor_copy_2d(tile, word, tmap, inner, row, bars, index)    # device: one box

`tensor_copy_2d` issues

    cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
        [dst], [tmap, {inner, row}], [bar];

(PTX ISA, Data Movement and Conversion Instructions: cp.async.bulk.tensor; sm_90). The box's
first element is (inner, row) in elements of the map's two dimensions; the engine writes the box
at shared word `word` of `tile` and performs complete_tx(box bytes) on bars[index] (mbarrier.py),
as bulk_copy.py's plain copy does. Rows and columns past the map's extent arrive as zeros, and
still count as bytes of the box. With the 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B) a box row
must be 128 bytes, and its 16-byte chunk c of box row r lands at chunk position c ^ (r % 8): the
pattern wgmma's 128-byte-swizzle descriptor reads (wgmma.py), so the box needs no rearranging.
The destination must then be aligned to the swizzle's 1024-byte atom.

Tensor maps. A map (CUtensorMap, 128 opaque bytes) holds the array's address, extents, row
stride, the box and the swizzle; the host encodes it with the driver's cuTensorMapEncodeTiled.
CUDA C++ passes it as a `__grid_constant__` kernel parameter, which Numba cannot spell, so
`tensor_map` copies the bytes to device memory and the kernel names the map by that address.
Bytes written there by an ordinary copy must be made visible to the copy engine's proxy before it
reads them: `acquire_tensor_map`, `fence.proxy.tensormap::generic.acquire.gpu` (PTX ISA,
Parallel Synchronization: membar/fence), once per map in the thread that issues the copies. Two
consequences for owners (docs/PERFORMANCE.md, "TMA"): a map holds an address, so the array must
outlive every launch that uses the map (a map of a freed array reads freed memory); and
`tensor_map`'s copy to the device is a synchronous memcpy, which a stream being captured into a
CUDA graph does not allow, so maps are made before capture (the engine's launch lists run eagerly
once before they are captured: engine/capture.py).

Simulator twin. The map is a key into a table of (array, rows, box, swizzle); the copy reads the
box at issue, applies the swizzle, and lands it after SIMULATED_COPY_DELAY (bulk_copy.py), then
completes the bytes on the barrier. So a kernel that reads a stage before its barrier, or refills
a stage still being read, fails its simulator test too; the twin also checks the destination's
alignment and that the box fits the tile.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from . import SIMULATOR, simulator_twin
from .bulk_copy import SIMULATED_COPY_DELAY
from .mbarrier import barrier_address, complete_tx_simulated, inline_ptx, shared_address
from .mma import _element_pointer, _is_words
from .wgmma import SWIZZLE_ATOM_BYTES  # a swizzled box starts on one

TENSOR_MAP_WORDS = 16  # a CUtensorMap: 128 bytes, 64-byte aligned (device allocations are 256-aligned)
SWIZZLE_ROW_BYTES = 128  # a box row under the 128-byte swizzle

_simulated_maps: dict[int, tuple] = {}  # the simulator's maps: key -> (array, rows, box_inner, box_rows, swizzle)
_map_keys = itertools.count(1)


def tensor_map(array, box_inner: int, box_rows: int, swizzle: bool, rows: int | None = None):
    """The tensor map of 2-D device `array` (rows x inner elements, C order; only its first `rows`
    rows, all by default), as a device uint64[TENSOR_MAP_WORDS]: boxes of box_rows x box_inner
    elements, written to shared memory in the 128-byte swizzle when `swizzle`; elements past the
    extents read as zeros. float16 and uint32 arrays."""
    rows = array.shape[0] if rows is None else rows
    inner = array.shape[1]
    if swizzle and box_inner * array.dtype.itemsize != SWIZZLE_ROW_BYTES:
        raise ValueError(f"a 128-byte swizzle needs {SWIZZLE_ROW_BYTES}-byte box rows, not "
                         f"{box_inner * array.dtype.itemsize}")
    if SIMULATOR:
        key = next(_map_keys)
        _simulated_maps[key] = (getattr(array, "_ary", array), rows, box_inner, box_rows, swizzle)
        words = np.zeros(TENSOR_MAP_WORDS, np.uint64)
        words[0] = key
        return cuda.to_device(words)
    from cuda.bindings import driver as cu

    dtypes = {np.dtype(np.float16): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
              np.dtype(np.uint32): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32}
    swizzle_mode = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else \
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    error, encoded = cu.cuTensorMapEncodeTiled(
        dtypes[np.dtype(array.dtype)], 2, array.device_ctypes_pointer.value,
        [cu.cuuint64_t(inner), cu.cuuint64_t(rows)], [cu.cuuint64_t(inner * array.dtype.itemsize)],
        [cu.cuuint32_t(box_inner), cu.cuuint32_t(box_rows)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_mode,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if error != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {error}")
    return cuda.to_device(np.frombuffer(ctypes.string_at(encoded.getPtr(), 8 * TENSOR_MAP_WORDS), np.uint64).copy())


def tensor_copy_2d_simulated(tile, word, tmap, inner, row, bars, index):
    """The copy engine's box: read at issue, landed (swizzled) a little later, then complete_tx."""
    source, rows, box_inner, box_rows, swizzle = _simulated_maps[int(tmap[0])]
    inner, row = int(inner), int(row)
    box = np.zeros((box_rows, box_inner), source.dtype)
    if row < rows and inner < source.shape[1]:
        found = source[row:min(rows, row + box_rows), inner:inner + box_inner]
        box[:found.shape[0], :found.shape[1]] = found
    data = box.view(np.uint8).reshape(box_rows, -1)
    start = 4 * int(word)
    if start % (SWIZZLE_ATOM_BYTES if swizzle else 128):
        raise RuntimeError(f"cp.async.bulk.tensor: shared byte {start} is not aligned for this box")
    if swizzle:
        chunks = data.reshape(box_rows, 8, 16)
        swizzled = np.empty_like(chunks)
        for r in range(box_rows):
            swizzled[r, np.arange(8) ^ (r % 8)] = chunks[r]
        data = swizzled
    payload = data.reshape(-1).copy()
    target = tile.view(np.uint8)
    if start + payload.size > target.size:
        raise RuntimeError("cp.async.bulk.tensor: the box overruns the shared tile")

    def land():
        target[start:start + payload.size] = payload
        complete_tx_simulated(bars, index, payload.size)

    threading.Timer(SIMULATED_COPY_DELAY, land).start()


@simulator_twin(tensor_copy_2d_simulated)
@intrinsic
def tensor_copy_2d(typingctx, tile, word, tmap, inner, row, bars, index):
    """Copy the box at (inner, row) of the tensor map at tmap (a device uint64[16]) into shared
    tile[word:], completing its bytes on bars[index]."""
    if not (_is_words(tile) and isinstance(word, types.Integer) and isinstance(tmap, types.Array)
            and tmap.dtype == types.uint64 and isinstance(inner, types.Integer) and isinstance(row, types.Integer)
            and isinstance(bars, types.Array) and bars.dtype == types.uint64 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        tile_t, word_t, map_t, inner_t, row_t, bars_t, index_t = sig.args
        tile_v, word_v, map_v, inner_v, row_v, bars_v, index_v = args
        dst = shared_address(context, builder, _element_pointer(context, builder, tile_t, tile_v, word_t, word_v))
        map_pointer = context.make_array(map_t)(context, builder, value=map_v).data
        map_address = builder.ptrtoint(map_pointer, ir.IntType(64))
        bar = barrier_address(context, builder, bars_t, bars_v, index_t, index_v)
        inline_ptx(builder, "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                            "[$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}",
                   [dst, map_address, context.cast(builder, inner_v, inner_t, types.int32),
                    context.cast(builder, row_v, row_t, types.int32), bar])
        return context.get_dummy_value()

    return types.void(tile, word, tmap, inner, row, bars, index), codegen


def acquire_tensor_map_simulated(tmap):
    return None  # the simulator's maps live in _simulated_maps, not in the device bytes


@simulator_twin(acquire_tensor_map_simulated)
@intrinsic
def acquire_tensor_map(typingctx, tmap):
    """`fence.proxy.tensormap::generic.acquire.gpu [tmap], 128;`: the map's bytes, written by an
    ordinary copy, as the copy engine will read them."""
    if not (isinstance(tmap, types.Array) and tmap.dtype == types.uint64):
        return None

    def codegen(context, builder, sig, args):
        pointer = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        inline_ptx(builder, "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l,~{memory}",
                   [builder.ptrtoint(pointer, ir.IntType(64))])
        return context.get_dummy_value()

    return types.void(tmap), codegen
