"""The PTX primitives' simulator twins inside kernels: warp shuffles and reductions (per-warp
exchange between simulated threads), the INT4 unpack and the GEMV's unpack-and-dot step, on fresh
random inputs."""

import numpy as np
import pytest
from numba import cuda, uint32

from pynanoqwen import quant
from pynanoqwen.kernels.gemv_int4_paths import dot8_prmt
from pynanoqwen.kernels.int4_unpack import PAIR_CONSTANTS, unpack8, unpack_pair
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.ptx.half2 import half2_to_float2
from pynanoqwen.ptx.warp import shfl_xor, warp_max, warp_sum

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"


@cuda.jit
def reduce_per_warp(values, sums, maxima, swapped):
    i = cuda.grid(1)
    sums[i] = warp_sum(values[i])
    maxima[i] = warp_max(values[i])
    swapped[i] = shfl_xor(uint32(i), uint32(5))


def test_warp_reductions_and_shuffle():
    rng = np.random.default_rng()
    values = rng.standard_normal(64).astype(np.float32)  # two warps, reduced separately
    sums, maxima = np.zeros(64, np.float32), np.zeros(64, np.float32)
    swapped = np.zeros(64, np.uint32)
    reduce_per_warp[1, 64](values, sums, maxima, swapped)
    for warp in (slice(0, 32), slice(32, 64)):
        # Butterfly order, as the GPU adds: every lane ends with the same float32 bits.
        expected = values[warp].copy()
        for mask in (16, 8, 4, 2, 1):
            expected = expected + expected[np.arange(32) ^ mask]
        assert np.array_equal(sums[warp], expected)
        assert abs(float(sums[warp][0]) - values[warp].astype(np.float64).sum()) < 1e-5
        assert np.all(maxima[warp] == values[warp].max())
    assert np.array_equal(swapped, np.arange(64) ^ 5)


@cuda.jit
def shuffle_in_partial_warp(out):
    i = cuda.grid(1)
    out[i] = shfl_xor(uint32(i), uint32(16))


def test_shuffle_from_missing_lane_raises():
    # 48 threads: the second warp has lanes 0..15 only, so lane 0 reading lane 16 is a bug.
    with pytest.raises(RuntimeError, match="does not have"):
        shuffle_in_partial_warp[1, 48](np.zeros(48, np.uint32))


def test_dot8_prmt_matches_the_unpack_reference():
    rng = np.random.default_rng()
    for _ in range(40):
        word = rng.integers(0, 2**32, dtype=np.uint32)
        x = (rng.integers(-32, 33, size=8) / 16).astype(np.float16)  # sums stay exact in FP16
        acc0 = (rng.integers(-32, 33, size=2) / 16).astype(np.float16)
        pairs = x.view(np.uint32)
        acc = dot8_prmt(word, *pairs, acc0.view(np.uint32)[0])
        lo, hi = half2_to_float2(acc)
        codes = quant.unpack_prmt_reference(np.array([word]))[0].astype(np.float64)
        assert lo == acc0[0] + codes[0::2] @ x[0::2].astype(np.float64)  # lane 0: even inputs
        assert hi == acc0[1] + codes[1::2] @ x[1::2].astype(np.float64)  # lane 1: odd inputs


def test_the_one_int4_unpack_matches_the_reference_pair_by_pair():
    """kernels/int4_unpack.py: unpack8, and unpack_pair with each pair's constants (as a wgmma lane
    calls it), give the reference's exact codes (quant.unpack_prmt_reference), every nibble value."""
    rng = np.random.default_rng()
    words = np.concatenate([rng.integers(0, 2**32, 30, dtype=np.uint32),
                            np.array([0, 0xFFFFFFFF, 0x88888888], np.uint32)])
    for word in words:
        codes = quant.unpack_prmt_reference(np.array([word]))[0]
        pairs = [np.array([p], np.uint32).view(np.float16) for p in unpack8(word)]
        assert np.array_equal(np.concatenate(pairs), codes)
        for j, constants in enumerate(PAIR_CONSTANTS):
            pair = np.array([unpack_pair(word, *constants)], np.uint32).view(np.float16)
            assert np.array_equal(pair, codes[2 * j:2 * j + 2])


@cuda.jit
def one_lane_raises_while_its_warp_waits(out):
    i = cuda.grid(1)
    if i == 7:
        out[1000] = 1.0  # out of bounds: the simulator raises in this thread only
    out[i] = warp_sum(out[i])


def test_a_failed_kernel_leaves_no_thread_and_no_swapped_module_behind():
    """Lane 7 raises; the other 31 wait for it at the shuffle. The simulator reports the IndexError at
    once, and the waiting lanes must end within seconds (the block was aborted), after which the
    kernel's module has numba's `cuda` again, so the next kernel can be built (ptx/rendezvous.py)."""
    import time

    import numba.cuda
    import pynanoqwen.ptx.warp as warp_module
    from simulated import join_simulated_threads

    with pytest.raises(IndexError):
        one_lane_raises_while_its_warp_waits[1, 32](np.zeros(32, np.float32))
    started = time.monotonic()
    assert join_simulated_threads(30) == []
    assert time.monotonic() - started < 10
    assert warp_module.cuda is numba.cuda and globals()["cuda"] is numba.cuda
