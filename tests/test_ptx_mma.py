"""The tensor-core primitives of pynanoqwen/ptx/mma.py: they compile inline for sm_90, and their
simulator twins mean what the instructions mean. The warp-level twins are checked against numpy
matrix products of fragments laid out by hand from the PTX ISA's fragment tables (written out
again here, independently of mma.py); the cp.async twin against the commit/wait rules. Fresh
random inputs every run. (tests/sim/test_gemm_sim.py runs the same twins inside simulated warps.)"""

import numpy as np
import pytest
from numba import cuda, float32, int32, uint32

from pynanoqwen.ptx.mma import (SHARED_ALIGNMENT, cp_async_16, cp_async_16_simulated, cp_async_commit_group,
                                cp_async_commit_group_simulated, cp_async_wait_group, cp_async_wait_group_simulated,
                                ld_shared_v4_u32, ld_shared_v4_u32_simulated, ldmatrix_x4, ldmatrix_x4_trans,
                                ldmatrix_x4_warp, mma_m16n8k16, mma_m16n8k16_warp, mma_m16n8k32_bytes_warp,
                                mma_m16n8k32_s8u8, mma_m16n8k32_u8u8)


def use_tensor_core_primitives(src, out):
    tile = cuda.shared.array(512, uint32, alignment=SHARED_ALIGNMENT)
    lane = cuda.threadIdx.x
    cp_async_16(tile, 4 * lane, src, 4 * lane, 16)
    cp_async_16(tile, 128 + 4 * lane, src, 4 * lane, 8)
    cp_async_commit_group()
    cp_async_wait_group(0)
    cuda.syncthreads()
    a0, a1, a2, a3 = ldmatrix_x4(tile, 4 * lane)
    b0, b1, b2, b3 = ldmatrix_x4_trans(tile, 256 + 4 * lane)
    w0, w1, w2, w3 = ld_shared_v4_u32(tile, 4 * lane)
    d0, d1, d2, d3 = mma_m16n8k16(a0, a1, a2, a3, b0, b1, float32(w0), float32(0), float32(0), float32(0))
    e0, e1, e2, e3 = mma_m16n8k16(a0, a1, a2, a3, b2, b3, d0, d1, d2, d3)
    out[lane] = e0 + e1 + e2 + e3 + float32(w1 ^ w2 ^ w3)


def test_primitives_compile_inline_for_sm90():
    ptx, _ = cuda.compile_ptx(use_tensor_core_primitives, "void(uint32[::1], float32[::1])", cc=(9, 0))
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    expected = {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 2, "ldmatrix.sync.aligned.m8n8.x4.shared.b16": 1,
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16": 1, "ld.shared.v4.u32": 1,
                "cp.async.cg.shared.global": 2, "cp.async.commit_group": 1, "cp.async.wait_group 0": 1}
    for instruction, count in expected.items():
        assert sum(line.startswith(instruction) for line in code) == count, instruction
    assert not any(line.startswith("call") for line in code)
    assert ".local" not in ptx
    assert ".shared .align 16" in ptx  # 16-byte accesses need the 16-byte-aligned tile


def half2(lo, hi) -> int:
    return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


def fragments(a, b, c):
    """Lane L's (a0..a3, b0, b1, c0..c3) for A 16x16, B 16x8, C 16x8 (PTX ISA, mma.m16n8k16 f16)."""
    lanes = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        k = 2 * t
        lanes.append((half2(a[g, k], a[g, k + 1]), half2(a[g + 8, k], a[g + 8, k + 1]),
                      half2(a[g, k + 8], a[g, k + 9]), half2(a[g + 8, k + 8], a[g + 8, k + 9]),
                      half2(b[k, g], b[k + 1, g]), half2(b[k + 8, g], b[k + 9, g]),
                      c[g, k], c[g, k + 1], c[g + 8, k], c[g + 8, k + 1]))
    return lanes


def test_mma_twin_is_the_fragment_matrix_product():
    rng = np.random.default_rng()
    for _ in range(5):
        a = rng.standard_normal((16, 16)).astype(np.float16)
        b = rng.standard_normal((16, 8)).astype(np.float16)
        c = rng.standard_normal((16, 8)).astype(np.float32)
        d = mma_m16n8k16_warp(fragments(a, b, c))
        expected = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
        for lane, result in enumerate(d):
            g, t = lane // 4, lane % 4
            assert result == (expected[g, 2 * t], expected[g, 2 * t + 1], expected[g + 8, 2 * t],
                              expected[g + 8, 2 * t + 1])
            assert all(isinstance(v, np.float32) for v in result)


def use_byte_mma(words, out):
    lane = cuda.threadIdx.x
    d0, d1, d2, d3 = mma_m16n8k32_u8u8(words[0], words[1], words[2], words[3], words[4], words[5], int32(lane),
                                       int32(0), int32(0), int32(0))
    e0, e1, e2, e3 = mma_m16n8k32_s8u8(words[0], words[1], words[2], words[3], words[4], words[5], d0, d1, d2, d3)
    out[lane] = e0 + e1 + e2 + e3


def test_byte_mma_compiles_and_assembles_for_sm90():
    from test_kernels_compile import assemble_sm90

    ptx, _ = cuda.compile_ptx(use_byte_mma, "void(uint32[::1], int32[::1])", cc=(9, 0))
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    for atype in ("u8", "s8"):
        assert sum(line.startswith(f"mma.sync.aligned.m16n8k32.row.col.s32.{atype}.u8.s32") for line in code) == 1
    assert "error" not in assemble_sm90(ptx).lower()


def byte_word(values) -> int:
    return int(np.array(values, dtype=np.int64).astype(np.uint8).view(np.uint32)[0])


@pytest.mark.parametrize("signed_a", [False, True])
def test_byte_mma_twin_is_the_exact_fragment_product(signed_a):
    """Fragments laid out from the PTX ISA's table for mma.m16n8k32 with integer type."""
    rng = np.random.default_rng()
    a = rng.integers(-128, 128, (16, 32)) if signed_a else rng.integers(0, 256, (16, 32))
    b = rng.integers(0, 256, (32, 8))
    c = rng.integers(-2**20, 2**20, (16, 8))
    lanes = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        k = 4 * t
        lanes.append((byte_word(a[g, k:k + 4]), byte_word(a[g + 8, k:k + 4]), byte_word(a[g, k + 16:k + 20]),
                      byte_word(a[g + 8, k + 16:k + 20]), byte_word(b[k:k + 4, g]), byte_word(b[k + 16:k + 20, g]),
                      c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]))
    d = mma_m16n8k32_bytes_warp(lanes, signed_a)
    expected = a @ b + c
    for lane, result in enumerate(d):
        g, t = lane // 4, lane % 4
        assert tuple(int(v) for v in result) == (expected[g, 2 * t], expected[g, 2 * t + 1], expected[g + 8, 2 * t],
                                                 expected[g + 8, 2 * t + 1])


def test_ldmatrix_twin_hands_out_mma_fragments():
    rng = np.random.default_rng()
    halves = rng.standard_normal((64, 8)).astype(np.float16)  # 64 rows of 16 bytes, in any order
    tile = halves.view(np.uint32).ravel()
    rows = rng.permutation(64)[:32]  # lane L points at tile row rows[L]: row L % 8 of matrix L // 8
    pointers = [(tile, 4 * int(row)) for row in rows]
    matrices = halves[rows].reshape(4, 8, 8)
    for trans in (False, True):
        got = ldmatrix_x4_warp(pointers, trans=trans)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(4):
                m = matrices[i].T if trans else matrices[i]
                assert got[lane][i] == half2(m[g, 2 * t], m[g, 2 * t + 1]), (trans, lane, i)


def test_cp_async_twin_lands_groups_at_wait_and_zero_fills():
    rng = np.random.default_rng()
    src = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    dst = np.zeros(32, np.uint32)
    cp_async_16_simulated(dst, 0, src, 8, 16)
    cp_async_commit_group_simulated()  # group 1
    cp_async_16_simulated(dst, 4, src, 12, 6)  # 6 bytes read, 10 zero-filled
    cp_async_16_simulated(dst, 8, src, 60, 0)  # nothing read: 16 zeros
    cp_async_commit_group_simulated()  # group 2
    dst[4:12] = 0xFFFFFFFF
    cp_async_wait_group_simulated(1)  # only group 1 must have landed
    assert np.array_equal(dst[0:4], src[8:12]) and np.all(dst[4:12] == 0xFFFFFFFF)
    cp_async_wait_group_simulated(0)
    partial = np.zeros(4, np.uint32)
    partial.view(np.uint8)[:6] = src[12:14].view(np.uint8)[:6]
    assert np.array_equal(dst[4:8], partial) and np.all(dst[8:12] == 0)


def test_16_byte_twins_reject_misaligned_or_outside_accesses():
    words = np.arange(16, dtype=np.uint32)
    assert ld_shared_v4_u32_simulated(words, 12) == (12, 13, 14, 15)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        ld_shared_v4_u32_simulated(words, 6)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        cp_async_16_simulated(words, 4, words, 2, 16)
    with pytest.raises(RuntimeError, match="outside"):
        cp_async_16_simulated(words, 0, words, 16, 4)
    with pytest.raises(RuntimeError, match="src-size"):
        cp_async_16_simulated(words, 0, words, 0, 17)

