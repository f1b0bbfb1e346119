"""cp.async.bulk.tensor: the copy engine moves one box of a 2-D tensor global -> shared, swizzled.

`tensor_copy_2d_to_shared(dst, maps, map_index, x, y, bars, i)` issues

    cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
        [dst], [map, {x, y}], [bar];

(PTX ISA, Data Movement and Conversion Instructions: cp.async.bulk.tensor; sm_90, PTX 8.0). Like
`cp.async.bulk` (bulk_copy.py) one thread issues it and the Tensor Memory Accelerator completes the
box's bytes on the mbarrier bars[i]. What the tensor form adds is the layout in shared memory: the
box lands as `box_rows` lines of `span` bytes (box_elems FP16, span = 32, 64 or 128) and the
16-byte chunk c of each line is stored at chunk c XOR (address bits 7.. of the line), the swizzle
the map names (CU_TENSOR_MAP_SWIZZLE_{span}B). Eight consecutive lines then hold the same logical
chunk in eight different 16-byte bank groups, so an `ldmatrix` whose eight row addresses are eight
lines at one column reads one wavefront instead of eight. `swizzled_word(w, mask)` is where a
reader finds logical word w of a box (mask = span // 16 - 1); the twin lays boxes out with the same
`swizzle` formula.

The map: a CUtensorMap, 128 opaque bytes made on the host by `encode_tensor_map_2d` (the driver's
cuTensorMapEncodeTiled) for one FP16 tensor in global memory, viewed as rows of `row_elems`
elements, and copied into a device array (`maps`, uint64 [n, 16]: one map a row, 64-byte aligned as
the instruction requires). The PTX operand is the generic address of maps[map_index]: a map may
live in global memory when no device code writes it. Coordinates are in elements: x the column of
the box's first element in a row, y its first row.

Rules: `dst` 128-byte aligned, and 1024-byte aligned for the 128-byte swizzle, whose pattern
repeats every 8 lines of 128 bytes and is computed from the shared address itself; the box inside
the tensor (the maps here ask for no out-of-bound fill); the barrier expecting box_rows x span
bytes before its phase can complete.

Simulator twin. Under the simulator `encode_tensor_map_2d` writes a map of our own layout (the
tensor's host address, its shape and the box) and the twin copies the box from that address with
the swizzle above, landing later as bulk_copy.py's twin does. It checks the box is inside the
tensor and that `dst` starts 1024 bytes into its shared array, where the GPU would silently
misplace or corrupt data.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from . import SIMULATOR, simulator_twin
from .bulk_copy import SIMULATED_COPY_DELAY, _data_pointer
from .mbarrier import barrier_address, complete_tx_simulated, inline_ptx, shared_address

MAP_WORDS = 16  # a CUtensorMap is 128 bytes, 64-byte aligned
SWIZZLE_ALIGNMENT = 1024  # bytes: where a box's 128-byte swizzle pattern starts over
CHUNK_BYTES = 16


def swizzle_span(box_elems: int) -> int:
    """The swizzle mode (bytes) of a box whose rows are box_elems FP16: the row's own bytes."""
    span = 2 * box_elems
    if span not in (32, 64, 128):
        raise ValueError(f"a swizzled box row must be 32, 64 or 128 bytes, not {span}")
    return span


def swizzle(w, mask):
    """Where logical 32-bit word w of a box sits in shared memory (the box 1024-byte aligned):
    its 16-byte chunk index XOR bits 7.. of its byte address, masked to the span's chunks."""
    return w ^ (((w >> 5) & mask) << 2)


swizzled_word = cuda.jit(device=True, inline="always")(swizzle)  # the kernels' spelling of swizzle()


def device_address(array) -> int:
    """The address of a device array's first element (under the simulator: of its host memory)."""
    if SIMULATOR:
        return np.asarray(array._ary if hasattr(array, "_ary") else array).ctypes.data
    return array.device_ctypes_pointer.value


def simulated_tensor_map(address: int, row_elems: int, rows: int, box_elems: int, box_rows: int) -> np.ndarray:
    """The simulator's map: what the twin needs of an FP16 tensor at host `address` and of the box."""
    fields = [address, row_elems, rows, box_elems, box_rows, swizzle_span(box_elems)]
    return np.array(fields + [0] * (MAP_WORDS - len(fields)), np.uint64)


def encode_tensor_map_2d(pool, box_elems: int, box_rows: int) -> np.ndarray:
    """The map (uint64[16]) of FP16 device array `pool`, C-contiguous, seen as rows of its last
    dimension, with a box of box_rows x box_elems and the matching swizzle."""
    row_elems = pool.shape[pool.ndim - 1]  # (the simulator's shapes take no negative index)
    rows = pool.size // row_elems
    span = swizzle_span(box_elems)
    if row_elems % box_elems or box_rows > 256 or pool.dtype != np.float16:
        raise ValueError(f"tensor map: FP16 rows of {row_elems} in boxes of {box_rows} x {box_elems}")
    if SIMULATOR:
        return simulated_tensor_map(device_address(pool), row_elems, rows, box_elems, box_rows)
    from cuda.bindings import driver

    swizzle = {32: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
               64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[span]
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, device_address(pool),
        [u64(row_elems), u64(rows)], [u64(2 * row_elems)], [u32(box_elems), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
    return np.ctypeslib.as_array((ctypes.c_uint64 * MAP_WORDS).from_address(tensor_map.getPtr())).copy()


def tensor_copy_2d_to_shared_simulated(dst, maps, map_index, x, y, bars, index):
    address, row_elems, rows, box_elems, box_rows, span = (int(v) for v in maps[map_index, :6])
    x, y = int(x), int(y)
    if not (0 <= x and x + box_elems <= row_elems and 0 <= y and y + box_rows <= rows):
        raise RuntimeError(f"cp.async.bulk.tensor: box at ({x}, {y}) outside the {rows} x {row_elems} tensor")
    root = dst  # the shared array the view was cut from: offsets count from its start, as the kernels' do
    while isinstance(root.base, np.ndarray):
        root = root.base
    if (dst.ctypes.data - root.ctypes.data) % SWIZZLE_ALIGNMENT:
        raise RuntimeError("cp.async.bulk.tensor: the swizzled destination is not 1024-byte aligned")
    tensor = np.ctypeslib.as_array((ctypes.c_uint16 * (rows * row_elems)).from_address(address))
    box = tensor.reshape(rows, row_elems)[y:y + box_rows, x:x + box_elems].copy().view(np.uint32).reshape(-1)
    mask = span // CHUNK_BYTES - 1
    landing = swizzle(np.arange(box.size), mask)
    dst_words = dst.reshape(-1).view(np.uint32)

    def land():
        dst_words[landing] = box
        complete_tx_simulated(bars, index, 4 * box.size)

    threading.Timer(SIMULATED_COPY_DELAY, land).start()


def _no_op(*args):
    return None


def _map_address(context, builder, maps_type, maps_v, map_index_type, map_index_v):
    """The generic address of maps[map_index] (one 128-byte map a row)."""
    row = context.cast(builder, map_index_v, map_index_type, types.int64)
    first = builder.ptrtoint(_data_pointer(context, builder, maps_type, maps_v), ir.IntType(64))
    return builder.add(first, builder.mul(row, ir.Constant(ir.IntType(64), 8 * MAP_WORDS)))


@simulator_twin(_no_op)
@intrinsic
def prefetch_tensormap(typingctx, maps, map_index):
    """`prefetch.tensormap [map];` bring maps[map_index] into the copy engine's descriptor cache
    ahead of the first copy that uses it (PTX ISA: prefetch; sm_90)."""
    if not (isinstance(maps, types.Array) and maps.ndim == 2 and isinstance(map_index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        address = _map_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        inline_ptx(builder, "prefetch.tensormap [$0];", "l,~{memory}", [address])
        return context.get_dummy_value()

    return types.void(maps, map_index), codegen


@simulator_twin(tensor_copy_2d_to_shared_simulated)
@intrinsic
def tensor_copy_2d_to_shared(typingctx, dst, maps, map_index, x, y, bars, index):
    """Copy the box at element (x, y) of the tensor that maps[map_index] describes into shared
    view `dst`, swizzled; the copy engine completes the box's bytes on barrier bars[index]."""
    ok = (isinstance(dst, types.Array) and isinstance(maps, types.Array) and maps.ndim == 2
          and maps.dtype == types.uint64 and isinstance(bars, types.Array) and bars.dtype == types.uint64
          and all(isinstance(v, types.Integer) for v in (map_index, x, y, index)))
    if not ok:
        return None

    def codegen(context, builder, sig, args):
        dst_type, maps_type, map_index_type, x_type, y_type, bars_type, index_type = sig.args
        dst_v, maps_v, map_index_v, x_v, y_v, bars_v, index_v = args
        dst_address = shared_address(context, builder, _data_pointer(context, builder, dst_type, dst_v))
        map_address = _map_address(context, builder, maps_type, maps_v, map_index_type, map_index_v)
        x32 = context.cast(builder, x_v, x_type, types.int32)
        y32 = context.cast(builder, y_v, y_type, types.int32)
        bar_address = barrier_address(context, builder, bars_type, bars_v, index_type, index_v)
        inline_ptx(builder,
                   "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[$0], [$1, {$2, $3}], [$4];",
                   "r,l,r,r,r,~{memory}", [dst_address, map_address, x32, y32, bar_address])
        return context.get_dummy_value()

    return types.void(dst, maps, map_index, x, y, bars, index), codegen
