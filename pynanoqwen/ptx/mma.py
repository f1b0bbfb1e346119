"""Tensor-core matrix multiply and the instructions that feed it: mma.sync, ldmatrix, cp.async.

Everything here is warp-level or asynchronous, which is why it needs more than one line of PTX
in its simulator twin. One intrinsic per instruction:

    mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, Warp Level Matrix Multiply-
        Accumulate Instructions: mma, and its section "Matrix Fragments for mma.m16n8k16 with
        floating point type"). The 32 lanes of a warp together compute D = A B + C for a 16x16
        FP16 A, a 16x8 FP16 B and a 16x8 FP32 C: 2048 multiply-adds in one instruction. Each lane
        holds a fixed piece of each matrix; with g = lane // 4 ("groupID") and t = lane % 4
        ("threadID_in_group"), and a half2 register holding two FP16 values, low half first:
            a0 = A[g, 2t:2t+2]    a1 = A[g+8, 2t:2t+2]    a2 = A[g, 2t+8:2t+10]    a3 = A[g+8, 2t+8:2t+10]
            b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]                        (B stored column by column)
            c0, c1 = C[g, 2t], C[g, 2t+1]                 c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
        and the four returned floats are D at the positions of c0..c3.
    mma_m16n8k32_u8u8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), mma_m16n8k32_s8u8(...)
        mma.sync.aligned.m16n8k32.row.col.s32.{u8,s8}.u8.s32 (the same section, "Matrix Fragments
        for mma.m16n8k32" with integer type): D = A B + C for a 16x32 A of unsigned (u8u8) or
        signed (s8u8) bytes, a 32x8 B of unsigned bytes and int32 C, D. Integer products and sums
        are exact (wrapping only past 2^31). A register holds four bytes, the lowest first:
            a0 = A[g, 4t:4t+4]    a1 = A[g+8, 4t:4t+4]    a2 = A[g, 4t+16:4t+20]   a3 = A[g+8, 4t+16:4t+20]
            b0 = B[4t:4t+4, g]    b1 = B[4t+16:4t+20, g]
            c0, c1 = C[g, 2t], C[g, 2t+1]                 c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
        and the four returned int32 are D at the positions of c0..c3.
    ldmatrix_x4(tile, index), ldmatrix_x4_trans(tile, index)
        ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA, Data Movement and Conversion
        Instructions: ldmatrix). Four 8x8 FP16 matrices from shared memory, distributed so that
        each lane gets one half2 of each: lane 8i + r passes the address of row r of matrix i
        (16 contiguous bytes, `tile[index:index+4]`), and lane (g, t) receives row g, columns
        2t..2t+1 of matrix i as its i-th register; with .trans, column g, rows 2t..2t+1 instead
        (the matrix transposed on the way). Those are exactly the mma fragments above.
    ld_shared_v4_u32(tile, index)
        ld.shared.v4.u32 (PTX ISA, Data Movement and Conversion Instructions: ld): one lane's 16
        bytes of shared memory. The INT4 GEMM builds its A fragments with it (see
        kernels/gemm_int4.py for why its fragments need no ldmatrix).
    cp_async_16(dst, dst_index, src, src_index, src_bytes), cp_async_commit_group(),
    cp_async_wait_group(n)
        cp.async.cg.shared.global, cp.async.commit_group, cp.async.wait_group (PTX ISA, Data
        Movement and Conversion Instructions: cp.async; sm_80+). A thread asks for 16 bytes to be
        copied from global to shared memory without passing through its registers and goes on at
        once; the first `src_bytes` come from `src`, the rest are zero-filled (`src_bytes` = 0
        writes 16 zero bytes and reads nothing). `.cg` caches in L2 only, since a tile is read
        once per block. commit_group closes the thread's copies issued so far into a group;
        wait_group(n) blocks until at most the n newest committed groups are still in flight.
        Afterwards the thread sees its own copies; other threads see them after a barrier
        (`cuda.syncthreads()`), which is how a multi-stage pipeline is built: issue stage s + n,
        wait for stage s, compute on stage s.

Operands. Shared-memory tiles are 1-D uint32 `cuda.shared.array`s, addressed by a word index; the
PTX operand is the 32-bit shared-window address (mbarrier.shared_address). Every 16-byte access
must be 16-byte aligned: the word index a multiple of 4, and the array declared with
`alignment=SHARED_ALIGNMENT`, because Numba aligns a shared array only to its element size.
Global sources are 1-D uint32 device arrays. The loads are marked as having side effects so that
LLVM keeps them where the kernel put them (after the barrier that publishes the tile, not hoisted
out of the k loop); ptxas still schedules them freely.

Simulator twins (NUMBA_ENABLE_CUDASIM=1). mma and ldmatrix are warp-cooperative: a lane's result
depends on the other 31 lanes' operands. Their lanes meet at the warp's rendezvous (rendezvous.py), as
warp.py's shuffles do: each lane deposits its operands, the last of the 32 to arrive computes the whole
warp's result (`mma_m16n8k16_warp`: D = A B + C in float64 over the 16x16x8 product, rounded once
to float32; `ldmatrix_x4_warp`) and wakes the others, and each lane takes its part. All 32 lanes
must execute the instruction together, as on the GPU (`.aligned`); a partial warp raises. The
warp-level functions are public, so tests check the fragment layouts against numpy without a
simulator. The cp.async twin keeps each simulated thread's copies in a queue: issuing reads the
source bytes, commit_group closes a group, and wait_group lands the groups that the real
instruction would have waited for. So a kernel that reads a stage before waiting for it sees the
stage's old contents, in the simulator as on the GPU, and its test fails.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import SIMULATOR, simulator_twin
from .mbarrier import inline_ptx, shared_address
from .rendezvous import cooperate

ADDRSPACE_GLOBAL = 1  # NVVM's address space for global memory

SHARED_ALIGNMENT = None if SIMULATOR else 16
"""`alignment=` for the shared tiles these instructions read or write (16-byte accesses). The
simulator rejects any alignment argument; its numpy arrays are 16-byte aligned anyway."""

_F32x4 = types.UniTuple(types.float32, 4)
_U32x4 = types.UniTuple(types.uint32, 4)


# --- Simulator twins --------------------------------------------------------------------------

def _halves(words) -> np.ndarray:
    """uint32 words -> their FP16 halves, low half first: shape [..., 2]."""
    return np.asarray(words, dtype=np.uint32)[..., None].view(np.float16)


_G, _T = np.arange(32) // 4, np.arange(32) % 4  # groupID and threadID_in_group of each lane


def mma_m16n8k16_warp(lanes: list) -> list:
    """What mma.m16n8k16 computes for a whole warp: lanes[L] = (a0, a1, a2, a3, b0, b1, c0, c1, c2,
    c3) of lane L -> [(d0, d1, d2, d3) of each lane], D = A B + C in float64, rounded once to float32."""
    a, b, c = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    a_halves = _halves([lane[0:4] for lane in lanes])  # [lane, register, half]
    b_halves = _halves([lane[4:6] for lane in lanes])
    c_values = np.array([lane[6:10] for lane in lanes], dtype=np.float32)
    for half in range(2):
        col = 2 * _T + half
        a[_G, col], a[_G + 8, col] = a_halves[:, 0, half], a_halves[:, 1, half]
        a[_G, col + 8], a[_G + 8, col + 8] = a_halves[:, 2, half], a_halves[:, 3, half]
        b[col, _G], b[col + 8, _G] = b_halves[:, 0, half], b_halves[:, 1, half]
        c[_G, col], c[_G + 8, col] = c_values[:, half], c_values[:, 2 + half]
    d = (a @ b + c).astype(np.float32)
    return [(d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]) for g, t in zip(_G, _T)]


def mma_m16n8k32_bytes_warp(lanes: list, signed_a: bool) -> list:
    """What mma.m16n8k32 with byte operands computes for a whole warp: lanes[L] = (a0, a1, a2, a3,
    b0, b1, c0, c1, c2, c3) of lane L -> [(d0, d1, d2, d3) of each lane], D = A B + C in exact
    integers (A's bytes signed when signed_a, B's unsigned), wrapped to int32."""
    a_bytes = np.array([lane[0:4] for lane in lanes], dtype=np.uint32).view(np.int8 if signed_a else np.uint8)
    b_bytes = np.array([lane[4:6] for lane in lanes], dtype=np.uint32).view(np.uint8)
    a_bytes, b_bytes = a_bytes.reshape(32, 4, 4).astype(np.int64), b_bytes.reshape(32, 2, 4).astype(np.int64)
    a, b = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64)
    c = np.array([lane[6:10] for lane in lanes], dtype=np.int64)
    for i in range(4):
        col = 4 * _T + i
        a[_G, col], a[_G + 8, col] = a_bytes[:, 0, i], a_bytes[:, 1, i]
        a[_G, col + 16], a[_G + 8, col + 16] = a_bytes[:, 2, i], a_bytes[:, 3, i]
        b[col, _G], b[col + 16, _G] = b_bytes[:, 0, i], b_bytes[:, 1, i]
    d = a @ b
    d[_G, 2 * _T] += c[:, 0]
    d[_G, 2 * _T + 1] += c[:, 1]
    d[_G + 8, 2 * _T] += c[:, 2]
    d[_G + 8, 2 * _T + 1] += c[:, 3]
    d = d.astype(np.int32)  # wraps as the hardware's 32-bit sums do
    return [(d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]) for g, t in zip(_G, _T)]


def mma_m16n8k32_u8u8_simulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return cooperate("mma.sync.u8u8", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3),
                     lambda lanes: mma_m16n8k32_bytes_warp(lanes, signed_a=False))


def mma_m16n8k32_s8u8_simulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return cooperate("mma.sync.s8u8", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3),
                     lambda lanes: mma_m16n8k32_bytes_warp(lanes, signed_a=True))


def _row_halves(row) -> np.ndarray:
    tile, index = row
    return np.asarray(tile[index:index + 4], dtype=np.uint32).view(np.float16)


def ldmatrix_x4_warp(rows: list, trans: bool = False) -> list:
    """What ldmatrix.x4 delivers to a whole warp: rows[L] = (tile, word index) that lane L points at
    (lane 8i + r: row r of matrix i) -> [4 half2 words of each lane]: lane (g, t) gets (row g,
    cols 2t, 2t+1) of each matrix, or with `trans` (col g, rows 2t, 2t+1)."""
    matrices = np.array([_row_halves(row) for row in rows]).reshape(4, 8, 8)  # [matrix, row, col]
    if trans:
        matrices = matrices.transpose(0, 2, 1)
    pairs = matrices[:, _G[:, None], 2 * _T[:, None] + np.arange(2)]  # [matrix, lane, half]
    words = pairs.copy().view(np.uint32)[..., 0]  # [matrix, lane]
    return [tuple(words[:, lane]) for lane in range(32)]


def mma_m16n8k16_simulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return cooperate("mma.sync", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), mma_m16n8k16_warp)


def _check_16_byte_access(instruction: str, array, index) -> int:
    index = int(index)
    if index % 4 or array.ctypes.data % 16:
        raise RuntimeError(f"{instruction}: word index {index} is not 16-byte aligned")
    if not 0 <= index <= array.size - 4:
        raise RuntimeError(f"{instruction}: words {index}..{index + 3} outside an array of {array.size}")
    return index


def ldmatrix_x4_simulated(tile, index):
    index = _check_16_byte_access("ldmatrix", tile, index)
    return cooperate("ldmatrix", (tile, index), ldmatrix_x4_warp)


def ldmatrix_x4_trans_simulated(tile, index):
    index = _check_16_byte_access("ldmatrix.trans", tile, index)
    return cooperate("ldmatrix.trans", (tile, index), lambda rows: ldmatrix_x4_warp(rows, trans=True))


def ld_shared_v4_u32_simulated(tile, index):
    index = _check_16_byte_access("ld.shared.v4", tile, index)
    return tuple(tile[index:index + 4])


class _CopyQueue:
    """One simulated thread's cp.async copies: the open group and the committed ones, oldest first."""

    def __init__(self):
        self.open = []
        self.committed = []


def _copy_queue() -> _CopyQueue:
    return threading.current_thread().__dict__.setdefault("_pynanoqwen_cp_async", _CopyQueue())


def cp_async_16_simulated(dst, dst_index, src, src_index, src_bytes):
    dst_index = _check_16_byte_access("cp.async destination", dst, dst_index)
    src_index, src_bytes = int(src_index), int(src_bytes)
    if not 0 <= src_bytes <= 16:
        raise RuntimeError(f"cp.async: src-size {src_bytes} outside 0..16")
    if src_index % 4:
        raise RuntimeError(f"cp.async: source word index {src_index} is not 16-byte aligned")
    words = -(-src_bytes // 4)
    if words and not 0 <= src_index <= len(src) - words:
        raise RuntimeError(f"cp.async: source words {src_index}..{src_index + words - 1} outside an array "
                           f"of {len(src)}")
    data = np.zeros(16, np.uint8)  # the bytes past src_bytes are zero-filled
    source = np.array([src[src_index + i] for i in range(words)], dtype=np.uint32)
    data[:src_bytes] = source.view(np.uint8)[:src_bytes]
    _copy_queue().open.append((dst, dst_index, data.view(np.uint32)))


def cp_async_commit_group_simulated():
    queue = _copy_queue()
    queue.committed.append(queue.open)
    queue.open = []


def cp_async_wait_group_simulated(n):
    queue = _copy_queue()
    while len(queue.committed) > int(n):
        for dst, dst_index, words in queue.committed.pop(0):
            dst[dst_index:dst_index + 4] = words


# --- The intrinsics ----------------------------------------------------------------------------

def _element_pointer(context, builder, array_type, array, index_type, index):
    """Pointer to array[index] of a 1-D array (no negative-index wraparound: indices are ours)."""
    index = context.cast(builder, index, index_type, types.intp)
    ary = context.make_array(array_type)(context, builder, value=array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index], wraparound=False)


def _shared_word_address(context, builder, sig, args):
    """32-bit shared-window address of tile[index], for intrinsics taking (tile, index) first."""
    return shared_address(context, builder, _element_pointer(context, builder, sig.args[0], args[0],
                                                             sig.args[1], args[1]))


def _is_words(array) -> bool:
    return isinstance(array, types.Array) and array.ndim == 1 and array.dtype == types.uint32


def _unpack_quad(context, builder, sig, quad):
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(quad, i) for i in range(4)])


_I32 = ir.IntType(32)
_QUAD = ir.LiteralStructType([_I32] * 4)


@simulator_twin(mma_m16n8k16_simulated)
@intrinsic
def mma_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3): this lane's part of D = A B + C for the warp's 16x16x8 FP16 product.

    a0..a3, b0, b1 are half2 bit patterns (uint32), c0..c3 float32, laid out as in the module
    docstring. `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`; all 32 lanes execute it.
    """
    words, floats = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
    if not (all(isinstance(w, types.Integer) for w in words) and all(f == types.float32 for f in floats)):
        return None

    def codegen(context, builder, sig, args):
        registers = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
        f32 = ir.FloatType()
        out = ir.LiteralStructType([f32] * 4)
        asm = ir.InlineAsm(ir.FunctionType(out, [_I32] * 6 + [f32] * 4),
                           "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        d = builder.call(asm, registers + list(args[6:]))
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])

    return _F32x4(*words, *floats), codegen


_I32x4 = types.UniTuple(types.int32, 4)


def _mma_bytes(atype: str):
    """The intrinsic mma.m16n8k32 .s32.`atype`.u8.s32 (module docstring)."""
    text = (f"mma.sync.aligned.m16n8k32.row.col.s32.{atype}.u8.s32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not all(isinstance(v, types.Integer) for v in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
            return None

        def codegen(context, builder, sig, args):
            registers = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            sums = [context.cast(builder, v, t, types.int32) for v, t in zip(args[6:], sig.args[6:])]
            asm = ir.InlineAsm(ir.FunctionType(_QUAD, [_I32] * 10), text, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
            return _unpack_quad(context, builder, sig, builder.call(asm, registers + sums))

        return _I32x4(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return typer


@simulator_twin(mma_m16n8k32_u8u8_simulated)
@intrinsic
def mma_m16n8k32_u8u8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3) int32: this lane's part of D = A B + C for the warp's 16x32x8 product of
    unsigned bytes, laid out as in the module docstring. `mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32`."""
    return _mma_bytes("u8")(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@simulator_twin(mma_m16n8k32_s8u8_simulated)
@intrinsic
def mma_m16n8k32_s8u8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """As mma_m16n8k32_u8u8 with A's bytes signed. `mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32`."""
    return _mma_bytes("s8")(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


def _ldmatrix(trans: bool):
    text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") +
            ".shared.b16 {$0, $1, $2, $3}, [$4];")

    def typer(typingctx, tile, index):
        if not (_is_words(tile) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            address = _shared_word_address(context, builder, sig, args)
            quad = inline_ptx(builder, text, "=r,=r,=r,=r,r,~{memory}", [address], _QUAD)
            return _unpack_quad(context, builder, sig, quad)

        return _U32x4(tile, index), codegen

    return typer


@simulator_twin(ldmatrix_x4_simulated)
@intrinsic
def ldmatrix_x4(typingctx, tile, index):
    """This lane's half2 of each of four 8x8 FP16 matrices in shared memory (mma fragments).

    `tile` is a 1-D uint32 shared array; this lane passes the word index of one matrix row
    (lane 8i + r: row r of matrix i, 16-byte aligned). Returns (row g, cols 2t..2t+1) of matrices
    0..3 for lane (g, t). `ldmatrix.sync.aligned.m8n8.x4.shared.b16`; all 32 lanes execute it.
    """
    return _ldmatrix(trans=False)(typingctx, tile, index)


@simulator_twin(ldmatrix_x4_trans_simulated)
@intrinsic
def ldmatrix_x4_trans(typingctx, tile, index):
    """As ldmatrix_x4, each matrix transposed: lane (g, t) gets (column g, rows 2t..2t+1).

    `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`; all 32 lanes execute it.
    """
    return _ldmatrix(trans=True)(typingctx, tile, index)


@simulator_twin(ld_shared_v4_u32_simulated)
@intrinsic
def ld_shared_v4_u32(typingctx, tile, index):
    """(tile[index], ..., tile[index + 3]) of a 1-D uint32 shared array, as one 16-byte load.

    `index` must be a multiple of 4 and `tile` 16-byte aligned. `ld.shared.v4.u32`.
    """
    if not (_is_words(tile) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        address = _shared_word_address(context, builder, sig, args)
        quad = inline_ptx(builder, "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                          [address], _QUAD)
        return _unpack_quad(context, builder, sig, quad)

    return _U32x4(tile, index), codegen


@simulator_twin(cp_async_16_simulated)
@intrinsic
def cp_async_16(typingctx, dst, dst_index, src, src_index, src_bytes):
    """Start copying 16 bytes from global src[src_index:src_index+4] to shared dst[dst_index:...+4].

    Both arrays are 1-D uint32, both indices multiples of 4. Only the first `src_bytes` (0..16)
    are read; the rest of the 16 destination bytes are zero-filled.
    `cp.async.cg.shared.global [dst], [src], 16, src_bytes;`
    """
    if not (_is_words(dst) and _is_words(src)
            and all(isinstance(i, types.Integer) for i in (dst_index, src_index, src_bytes))):
        return None

    def codegen(context, builder, sig, args):
        dst_type, dst_index_type, src_type, src_index_type, size_type = sig.args
        dst_v, dst_index_v, src_v, src_index_v, size_v = args
        dst_address = shared_address(context, builder,
                                     _element_pointer(context, builder, dst_type, dst_v, dst_index_type, dst_index_v))
        src_pointer = _element_pointer(context, builder, src_type, src_v, src_index_type, src_index_v)
        src_global = builder.addrspacecast(src_pointer, ir.PointerType(src_pointer.type.pointee, ADDRSPACE_GLOBAL))
        src_address = builder.ptrtoint(src_global, ir.IntType(64))
        size = context.cast(builder, size_v, size_type, types.uint32)
        inline_ptx(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                   [dst_address, src_address, size])
        return context.get_dummy_value()

    return types.void(dst, dst_index, src, src_index, src_bytes), codegen


@simulator_twin(cp_async_commit_group_simulated)
@intrinsic
def cp_async_commit_group(typingctx):
    """Close this thread's cp.async copies issued so far into one group. `cp.async.commit_group;`"""

    def codegen(context, builder, sig, args):
        inline_ptx(builder, "cp.async.commit_group;", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(), codegen


@simulator_twin(cp_async_wait_group_simulated)
@intrinsic
def cp_async_wait_group(typingctx, n):
    """Wait until at most the `n` newest committed groups of this thread are still in flight.

    `n` must be a compile-time constant (a literal or a closure constant): the instruction
    takes it as an immediate. `cp.async.wait_group n;`
    """
    if not isinstance(n, types.IntegerLiteral):
        return None
    pending = int(n.literal_value)

    def codegen(context, builder, sig, args):
        inline_ptx(builder, f"cp.async.wait_group {pending};", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(n), codegen
