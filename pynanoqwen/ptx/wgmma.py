"""Hopper warpgroup matrix multiply (wgmma) and the fences around it: sm_90a only.

A warpgroup is four consecutive warps (128 threads, the first warp's index a multiple of 4).
`wgmma.mma_async` multiplies a 64 x 16 A by a 16 x N B into a 64 x N FP32 accumulator spread
over the warpgroup's registers, and runs asynchronously: the instruction is issued, the warps go
on (dequantizing the next weights, say), and `wgmma.wait_group` later waits for it. It reaches
the tensor cores' full rate on Hopper, which `mma.sync` (ptx/mma.py) does not. PTX ISA,
"Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"; numba-cuda compiles for
compute_90a whenever the GPU is 9.0, so the instructions are there at run time (CI compiles with
cc=(9, 0, "a")).

    wgmma_f16(acc, n, a0, a1, a2, a3, tile, index)
        wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 with A from registers and B from
        shared memory: acc[0 : n/2] += A B^T. Warp w of the warpgroup holds rows 16w..16w+15 of A
        exactly as one mma.m16n8k16 A fragment (ptx/mma.py): with g = lane // 4, t = lane % 4,
            a0 = A[16w+g, 2t:2t+2]   a1 = A[16w+g+8, 2t:2t+2]   a2 = A[16w+g, 2t+8:2t+10]   a3 = A[16w+g+8, 2t+8:2t+10]
        and acc, a local float32 array of n/2, holds D the same way for each 8-column slice i:
            acc[4i], acc[4i+1] = D[16w+g, 8i+2t], D[16w+g, 8i+2t+1]
            acc[4i+2], acc[4i+3] = D[16w+g+8, 8i+2t], D[16w+g+8, 8i+2t+1]
        B is n rows (N) of 16 FP16 (K) each, stored "K-major, 128-byte swizzle": row r's 64-wide
        k slab is 128 bytes at byte r * 128 of an atom of 8 rows (1024 bytes, atoms back to back,
        the tile 1024-byte aligned), its 16-byte chunk c stored at chunk position c ^ (r % 8).
        `index` is the word index of k column 0 of this 16-wide k step in row 0 (the slab start
        plus 8 words per k step). 16-byte copies of row r's chunks to those positions write it
        without bank conflicts, and the tensor cores read it without any.
        The instruction's B descriptor (start address >> 4, leading-dimension offset unused,
        stride 1024 bytes between 8-row atoms, swizzle mode 1 = 128 bytes) is built from the
        shared address of tile[index].
    wgmma_f16_mn(acc, n, a0, a1, a2, a3, tile, index, slab_bytes)
        The same product with B read "MN-major" (the instruction's transposed-B immediate, 1): B
        as 16 k rows of n values, the layout of a tile of rows whose values are the N dimension
        (the V tile of attention, O += P V, its keys the k rows). The values come in 64-wide
        slabs of 128-byte rows, slab j at `slab_bytes` j from slab 0 (the descriptor's leading
        byte offset); in a slab, k row r is 128 bytes at byte r * 128 of its 8-row atom (1024
        bytes, atoms back to back: the stride byte offset), its 16-byte chunk c (values 8c..8c+7)
        at chunk position c ^ (r % 8). So a tile of 128-byte rows stored as wgmma_f16 reads K is
        also a B operand here, its rows the k dimension. `index` is the word index of k row 0 of
        this k step in slab 0 (the tile start plus 512 words a k step of 16 rows).
    wgmma_fence()        wgmma.fence.sync.aligned: before the first wgmma, and again whenever A
                         registers or accumulators were written by other instructions.
    wgmma_commit_group() wgmma.commit_group.sync.aligned: the wgmmas issued so far form a group.
    wgmma_wait_group(n)  wgmma.wait_group.sync.aligned n: until at most n groups are in flight;
                         only then may the accumulators be read, or the shared memory and A
                         registers of the finished groups be reused.
    fence_proxy_async_shared()
                         fence.proxy.async.shared::cta: shared memory written by the generic
                         proxy (cp.async, st.shared) becomes visible to the async proxy the
                         tensor cores read through. Each writing thread runs it after its copies
                         landed and before the barrier that publishes them.
    shared_byte_address(tile, index)
                         the 32-bit shared-window address of tile[index], to align a dynamic
                         shared array to the 1024 bytes the swizzled layout needs.

The accumulators move between the local array and the instruction's registers through LLVM, which
promotes the array to registers (every index is a constant). ptxas sees the asynchronous register
use and keeps the registers of a wgmma in flight untouched until its wait.

Simulator twins (NUMBA_ENABLE_CUDASIM=1): wgmma is warpgroup-cooperative. Each of the 128 threads
deposits its A fragment at a meeting point (ptx/mma.py's, 128 lanes wide); the last to arrive
reads B out of the shared tile through the swizzle, computes D = A B^T + C in float64 rounded
once to float32, and every thread takes its part. The simulated instruction completes at once,
so the fences and waits are no-ops there; a kernel that overwrote a stage before waiting would
pass in the simulator and fail on the GPU, which the GPU tests catch.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from . import simulator_twin
from .mbarrier import inline_ptx, shared_address
from .rendezvous import cooperate
from .mma import _element_pointer, _halves, _is_words

SWIZZLE_ATOM_BYTES = 1024  # 8 rows of 128 bytes: the 128-byte swizzle pattern repeats after this
ROW_BYTES = 128  # one row's 64-wide FP16 k slab
K_STEP_WORDS = 8  # 16 FP16 of k: how far `index` moves per wgmma k step
WARPGROUP = 128
SHAPES_N = (64, 128)  # the wgmma widths the GEMM issues (PTX allows any multiple of 8 up to 256, but
# LLVM keeps a local array of more than 64 accumulators in memory, so 256 tokens are two n128 wgmmas)
MAX_N = 128  # the widest n wgmma_f16 takes, for that reason; any multiple of 8 up to it


def check_width(n: int) -> None:
    if n % 8 or not 8 <= n <= MAX_N:
        raise ValueError(f"wgmma_f16: n = {n} is not a multiple of 8 from 8 to {MAX_N}")


# --- Simulator twins --------------------------------------------------------------------------

def wgmma_warpgroup(lanes: list, n: int, read_b) -> list:
    """What wgmma m64n{n}k16 computes for a whole warpgroup: lanes[L] = (acc, a0, a1, a2, a3, tile,
    index) of thread L -> [n/2 float32 accumulators of each thread], D = A B^T + C in float64 rounded
    once to float32, B = read_b(tile, index) (n x 16, through the 128-byte swizzle)."""
    a, c = np.zeros((64, 16)), np.zeros((64, n))
    tile, index = lanes[0][5], int(lanes[0][6])
    for thread, (acc, a0, a1, a2, a3, _, _) in enumerate(lanes):
        warp, lane = divmod(thread, 32)
        g, t = lane // 4, lane % 4
        row = 16 * warp + g
        halves = _halves([a0, a1, a2, a3])
        a[row, 2 * t:2 * t + 2], a[row + 8, 2 * t:2 * t + 2] = halves[0], halves[1]
        a[row, 2 * t + 8:2 * t + 10], a[row + 8, 2 * t + 8:2 * t + 10] = halves[2], halves[3]
        for i in range(n // 8):
            c[row, 8 * i + 2 * t:8 * i + 2 * t + 2] = acc[4 * i:4 * i + 2]
            c[row + 8, 8 * i + 2 * t:8 * i + 2 * t + 2] = acc[4 * i + 2:4 * i + 4]
    b = read_b(tile, index)
    d = (a @ b.T + c).astype(np.float32)
    results = []
    for thread in range(WARPGROUP):
        warp, lane = divmod(thread, 32)
        g, t = lane // 4, lane % 4
        row = 16 * warp + g
        mine = np.empty(n // 2, np.float32)
        for i in range(n // 8):
            mine[4 * i:4 * i + 2] = d[row, 8 * i + 2 * t:8 * i + 2 * t + 2]
            mine[4 * i + 2:4 * i + 4] = d[row + 8, 8 * i + 2 * t:8 * i + 2 * t + 2]
        results.append(mine)
    return results


def b_k_major(tile, index, n) -> np.ndarray:
    """B (n x 16) of wgmma_f16: n K-major rows of the 128-byte-swizzled tile at word `index`."""
    words = np.asarray(tile, dtype=np.uint32)
    b = np.zeros((n, 16))
    k_word = index % (ROW_BYTES // 4)  # the k step's first word within its row
    for r in range(n):
        row_word = index - k_word + (r // 8) * (SWIZZLE_ATOM_BYTES // 4) + (r % 8) * (ROW_BYTES // 4)
        for half in range(2):  # the k step's two 16-byte chunks
            chunk = k_word // 4 + half
            at = row_word + 4 * (chunk ^ (r % 8))  # the 128-byte swizzle
            b[r, 8 * half:8 * half + 8] = words[at:at + 4].view(np.float16)
    return b


def b_mn_major(tile, index, n, slab_bytes) -> np.ndarray:
    """B (n x 16, as b_k_major gives it) of wgmma_f16_mn: 16 MN-major k rows of n values."""
    words = np.asarray(tile, dtype=np.uint32)
    b = np.zeros((n, 16))
    for k in range(16):
        row_word = index + (k // 8) * (SWIZZLE_ATOM_BYTES // 4) + (k % 8) * (ROW_BYTES // 4)
        for c in range(n // 8):  # chunk c of the values: slab c // 8, chunk c % 8 in its row
            at = row_word + (c // 8) * (slab_bytes // 4) + 4 * ((c % 8) ^ (k % 8))
            b[8 * c:8 * c + 8, k] = words[at:at + 4].view(np.float16)
    return b


def wgmma_f16_simulated(acc, n, a0, a1, a2, a3, tile, index):
    n = int(n)
    check_width(n)
    mine = cooperate("wgmma", (np.array(acc[:n // 2]), a0, a1, a2, a3, tile, index),
                      lambda lanes: wgmma_warpgroup(lanes, n, lambda t, i: b_k_major(t, int(i), n)),
                      width=WARPGROUP)
    acc[:n // 2] = mine


def wgmma_f16_mn_simulated(acc, n, a0, a1, a2, a3, tile, index, slab_bytes):
    n, slab_bytes = int(n), int(slab_bytes)
    check_width(n)
    mine = cooperate("wgmma", (np.array(acc[:n // 2]), a0, a1, a2, a3, tile, index),
                      lambda lanes: wgmma_warpgroup(lanes, n, lambda t, i: b_mn_major(t, int(i), n, slab_bytes)),
                      width=WARPGROUP)
    acc[:n // 2] = mine


def _no_op(*args):
    return None


def shared_byte_address_simulated(tile, index):
    return int(index) * 4  # the simulator's tiles are numpy arrays: offsets from the tile start


# --- The intrinsics ----------------------------------------------------------------------------

def _statement(text):
    """An intrinsic that emits one fixed PTX statement (no operands)."""

    def typer(typingctx):
        def codegen(context, builder, sig, args):
            inline_ptx(builder, text, "~{memory}", [])
            return context.get_dummy_value()

        return types.void(), codegen

    return typer


@simulator_twin(_no_op)
@intrinsic
def wgmma_fence(typingctx):
    """`wgmma.fence.sync.aligned;` all 128 threads of the warpgroup execute it."""
    return _statement("wgmma.fence.sync.aligned;")(typingctx)


@simulator_twin(_no_op)
@intrinsic
def wgmma_commit_group(typingctx):
    """`wgmma.commit_group.sync.aligned;` the wgmmas issued so far form one group."""
    return _statement("wgmma.commit_group.sync.aligned;")(typingctx)


@simulator_twin(_no_op)
@intrinsic
def fence_proxy_async_shared(typingctx):
    """`fence.proxy.async.shared::cta;` this thread's shared-memory writes become visible to wgmma."""
    return _statement("fence.proxy.async.shared::cta;")(typingctx)


@simulator_twin(_no_op)
@intrinsic
def wgmma_wait_group(typingctx, n):
    """`wgmma.wait_group.sync.aligned n;` n a compile-time constant (an immediate)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    pending = int(n.literal_value)

    def codegen(context, builder, sig, args):
        inline_ptx(builder, f"wgmma.wait_group.sync.aligned {pending};", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(n), codegen


@simulator_twin(shared_byte_address_simulated)
@intrinsic
def shared_byte_address(typingctx, tile, index):
    """uint32 shared-window address of tile[index] (a 1-D uint32 shared array)."""
    if not (_is_words(tile) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return shared_address(context, builder, _element_pointer(context, builder, sig.args[0], args[0],
                                                                 sig.args[1], args[1]))

    return types.uint32(tile, index), codegen


_DESCRIPTOR_FIXED = (1 << 16) | ((SWIZZLE_ATOM_BYTES >> 4) << 32) | (1 << 62)
"""Descriptor fields of wgmma_f16's B besides the start address: leading-dimension byte offset 1
(encoded; unused by a K-major swizzled operand whose k step lies inside one 128-byte row),
stride-dimension byte offset 1024 >> 4 (from one 8-row atom to the next), base offset 0 (atoms
1024-byte aligned), swizzle mode 1 (128 bytes) in bits 62-63."""


def _descriptor_mn(slab_bytes: int) -> int:
    """wgmma_f16_mn's fixed descriptor fields: leading-dimension byte offset = from one 64-wide slab
    of values to the next (the MN direction), stride-dimension byte offset = from one 8-row atom of
    k rows to the next, the rest as _DESCRIPTOR_FIXED (CUTLASS's canonical MN-major 128-byte layout,
    ((8, n), (8, k)) : ((1, LBO), (8, SBO)) in 16-byte units)."""
    if slab_bytes % SWIZZLE_ATOM_BYTES or not 0 < slab_bytes < 1 << 18:
        raise ValueError(f"wgmma_f16_mn: slab_bytes = {slab_bytes} is not a multiple of 1024 below 2^18")
    return ((slab_bytes >> 4) << 16) | ((SWIZZLE_ATOM_BYTES >> 4) << 32) | (1 << 62)


def _wgmma_codegen(width: int, fixed: int, transpose_b: int):
    """The codegen of one `wgmma.mma_async` m64n{width}k16 f32 += f16 x f16, A from registers, B
    through a descriptor of the shared address of tile[index] and the `fixed` fields."""
    registers = width // 2

    def codegen(context, builder, sig, args):
        acc_type, _, *a_types, tile_type, index_type = sig.args[:8]
        acc_v, _, *a_values, tile_v, index_v = args[:8]
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        data = context.make_array(acc_type)(context, builder, value=acc_v).data
        slots = [cgutils.gep(builder, data, i) for i in range(registers)]
        c = [builder.load(slot) for slot in slots]
        a = [context.cast(builder, v, t, types.uint32) for v, t in zip(a_values, a_types)]
        address = shared_address(context, builder, _element_pointer(context, builder, tile_type, tile_v,
                                                                    index_type, index_v))
        start = builder.lshr(builder.and_(builder.zext(address, i64), ir.Constant(i64, 0x3FFFF)),
                             ir.Constant(i64, 4))
        descriptor = builder.or_(start, ir.Constant(i64, fixed))
        d_list = ", ".join(f"${i}" for i in range(registers))
        a_list = ", ".join(f"${registers + i}" for i in range(4))
        text = ("{ .reg .pred p; setp.ne.b32 p, 1, 0; "
                f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.f16.f16 {{{d_list}}}, {{{a_list}}}, "
                f"${registers + 4}, p, 1, 1, {transpose_b}; }}")
        constraints = ",".join(["=f"] * registers + ["r"] * 4 + ["l"] + [str(i) for i in range(registers)])
        out = ir.LiteralStructType([f32] * registers)
        fn_type = ir.FunctionType(out, [i32] * 4 + [i64] + [f32] * registers)
        d = builder.call(ir.InlineAsm(fn_type, text, constraints + ",~{memory}", side_effect=True),
                         a + [descriptor] + c)
        for i, slot in enumerate(slots):
            builder.store(builder.extract_value(d, i), slot)
        return context.get_dummy_value()

    return codegen


def _operands_typed(acc, n, a0, a1, a2, a3, tile, index) -> bool:
    return (isinstance(acc, types.Array) and acc.dtype == types.float32 and isinstance(n, types.IntegerLiteral)
            and all(isinstance(a, types.Integer) for a in (a0, a1, a2, a3))
            and _is_words(tile) and isinstance(index, types.Integer))


@simulator_twin(wgmma_f16_simulated)
@intrinsic
def wgmma_f16(typingctx, acc, n, a0, a1, a2, a3, tile, index):
    """acc[0 : n/2] += this warpgroup's 64 x 16 A (registers) times B^T, B the n x 16 FP16 slice of
    a 128-byte-swizzled K-major shared tile at tile[index]; see the module docstring for layouts.

    `wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16`, asynchronous: the accumulators are
    valid only after wgmma_commit_group() and wgmma_wait_group(). n is a compile-time constant,
    a multiple of 8 up to MAX_N (the GEMM issues SHAPES_N, prefill attention 64).
    """
    if not _operands_typed(acc, n, a0, a1, a2, a3, tile, index):
        return None
    width = int(n.literal_value)
    check_width(width)
    return types.void(acc, n, a0, a1, a2, a3, tile, index), _wgmma_codegen(width, _DESCRIPTOR_FIXED, 0)


@simulator_twin(wgmma_f16_mn_simulated)
@intrinsic
def wgmma_f16_mn(typingctx, acc, n, a0, a1, a2, a3, tile, index, slab_bytes):
    """wgmma_f16 with B MN-major (16 k rows of n values, 64-wide slabs `slab_bytes` apart; the
    module docstring has the layout): prefill attention's O += P V, V's keys the k rows. n and
    slab_bytes are compile-time constants."""
    if not (_operands_typed(acc, n, a0, a1, a2, a3, tile, index) and isinstance(slab_bytes, types.IntegerLiteral)):
        return None
    width = int(n.literal_value)
    check_width(width)
    fixed = _descriptor_mn(int(slab_bytes.literal_value))
    return (types.void(acc, n, a0, a1, a2, a3, tile, index, slab_bytes),
            _wgmma_codegen(width, fixed, 1))
