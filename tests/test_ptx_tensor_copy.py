"""The copy engine's swizzled box copy (ptx/tensor_copy.py): it compiles inline for sm_90; its twin
lands a box where `swizzle` says, which puts eight lines' same chunk in eight bank groups, and
refuses what the hardware would get wrong; on the GPU the hardware lands the box exactly there."""

import numpy as np
import pytest
from numba import cuda, types

from pynanoqwen.ptx.mbarrier import (fence_barrier_init, mbarrier_arrive_expect_tx, mbarrier_arrive_expect_tx_simulated,
                                     mbarrier_init, mbarrier_init_simulated, mbarrier_try_wait_parity_simulated,
                                     mbarrier_wait)
from pynanoqwen.ptx.tensor_copy import (SWIZZLE_ALIGNMENT, simulated_tensor_map, swizzle,
                                        tensor_copy_2d_to_shared, tensor_copy_2d_to_shared_simulated)
from pynanoqwen.ptx.wgmma import shared_byte_address

BOX_ELEMS, BOX_ROWS = 64, 16  # decode attention's box at head_dim 128: 16 key rows of 128 bytes
BOX_WORDS = BOX_ELEMS * BOX_ROWS // 2
SHARED_WORDS = BOX_WORDS + SWIZZLE_ALIGNMENT // 4  # the box and the slack to align it


def expected_landing(tensor: np.ndarray, x: int, y: int, box_elems: int = BOX_ELEMS) -> np.ndarray:
    """The box's words where the 128-, 64- or 32-byte swizzle puts them (written out per chunk)."""
    box = tensor[y:y + BOX_ROWS, x:x + box_elems]
    span = 2 * box_elems
    chunks = span // 16
    out = np.zeros(BOX_ROWS * span // 4, np.uint32)
    for line in range(BOX_ROWS):
        address = line * span
        for chunk in range(chunks):
            # Address bits 4.. (the chunk) XOR bits 7.. (the 128-byte row of the 1024-byte atom).
            place = ((address + 16 * chunk) ^ ((((address + 16 * chunk) >> 7) & (chunks - 1)) << 4)) // 4
            out[place:place + 4] = box[line, 8 * chunk:8 * chunk + 8].view(np.uint32)
    return out


def copy_one_box(maps, x, y, out):
    smem = cuda.shared.array(SHARED_WORDS, types.uint32)
    bars = cuda.shared.array(1, types.uint64)
    at = (SWIZZLE_ALIGNMENT - shared_byte_address(smem, 0) % SWIZZLE_ALIGNMENT) % SWIZZLE_ALIGNMENT // 4
    if cuda.threadIdx.x == 0:
        mbarrier_init(bars, 0, 1)
        fence_barrier_init()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        mbarrier_arrive_expect_tx(bars, 0, 4 * BOX_WORDS)
        tensor_copy_2d_to_shared(smem[at:at + BOX_WORDS], maps, 1, x[0], y[0], bars, 0)
    mbarrier_wait(bars, 0, 0)
    for w in range(cuda.threadIdx.x, BOX_WORDS, cuda.blockDim.x):
        out[w] = smem[at + w]


def test_tensor_copy_compiles_inline_for_sm90():
    ptx, _ = cuda.compile_ptx(copy_one_box, "void(uint64[:, ::1], int32[::1], int32[::1], uint32[::1])", cc=(9, 0))
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    assert any("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in line
               for line in code)
    assert not any(line.startswith("call") for line in code)


@pytest.mark.parametrize("box_elems", [64, 32, 16])
def test_twin_lands_the_box_swizzled(box_elems):
    rng = np.random.default_rng()
    tensor = rng.standard_normal((64, 128)).astype(np.float16)
    maps = np.stack([np.zeros(16, np.uint64),
                     simulated_tensor_map(tensor.ctypes.data, 128, 64, box_elems, BOX_ROWS)])
    words = BOX_ROWS * box_elems // 2
    shared = np.zeros(2 * SWIZZLE_ALIGNMENT // 4 + words, np.uint32)
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 1)
    mbarrier_arrive_expect_tx_simulated(bars, 0, 4 * words)
    at = SWIZZLE_ALIGNMENT // 4
    tensor_copy_2d_to_shared_simulated(shared[at:at + words], maps, 1, 128 - box_elems, 32, bars, 0)
    assert mbarrier_try_wait_parity_simulated(bars, 0, 0)
    assert np.array_equal(shared[at:at + words], expected_landing(tensor, 128 - box_elems, 32, box_elems))
    assert not shared[:at].any() and not shared[at + words:].any()


def test_eight_lines_put_one_chunk_in_eight_bank_groups():
    """What the swizzle is for: ldmatrix's 8 row addresses (8 consecutive lines, one logical
    chunk) fall in 8 different 16-byte groups of the 32 banks, for the 128- and 64-byte lines."""
    for span in (128, 64):
        mask, line_words = span // 16 - 1, span // 4
        for first in (0, 8):
            for chunk in range(span // 16):
                words = [swizzle((first + line) * line_words + 4 * chunk, mask) for line in range(8)]
                assert len({(w // 4) % 8 for w in words}) == 8, (span, first, chunk)


def test_twin_refuses_a_box_outside_the_tensor_and_a_misaligned_destination():
    tensor = np.zeros((32, 128), np.float16)
    maps = simulated_tensor_map(tensor.ctypes.data, 128, 32, BOX_ELEMS, BOX_ROWS)[None]
    shared = np.zeros(SWIZZLE_ALIGNMENT // 4 + BOX_WORDS, np.uint32)
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 1)
    with pytest.raises(RuntimeError, match="outside"):
        tensor_copy_2d_to_shared_simulated(shared[:BOX_WORDS], maps, 0, 0, 17, bars, 0)
    with pytest.raises(RuntimeError, match="outside"):
        tensor_copy_2d_to_shared_simulated(shared[:BOX_WORDS], maps, 0, 96, 0, bars, 0)
    with pytest.raises(RuntimeError, match="1024-byte aligned"):
        tensor_copy_2d_to_shared_simulated(shared[128:128 + BOX_WORDS], maps, 0, 0, 0, bars, 0)


@pytest.mark.gpu
def test_hardware_lands_the_box_where_the_twin_does():
    from pynanoqwen.ptx.tensor_copy import encode_tensor_map_2d

    rng = np.random.default_rng()
    tensor = cuda.to_device(rng.standard_normal((4, 3, 16, 128)).astype(np.float16))  # a KV pool's shape
    maps = cuda.to_device(np.stack([np.zeros(16, np.uint64), encode_tensor_map_2d(tensor, BOX_ELEMS, BOX_ROWS)]))
    out = cuda.to_device(np.zeros(BOX_WORDS, np.uint32))
    x, y = 64, (2 * 3 + 1) * 16  # the second box of page 2, KV head 1
    cuda.jit(copy_one_box)[1, 128](maps, cuda.to_device(np.array([x], np.int32)), cuda.to_device(np.array([y], np.int32)), out)
    cuda.synchronize()
    host = tensor.copy_to_host().reshape(-1, 128)
    assert np.array_equal(out.copy_to_host(), expected_landing(host, x, y))
