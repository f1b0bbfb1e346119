"""The Hopper copy primitives (ptx/mbarrier.py, ptx/bulk_copy.py): they compile inline for sm_90,
and their simulator twins keep the mbarrier's books (arrivals, transaction bytes, phase parity) and
copy bytes the way the hardware does, rejecting what the hardware forbids."""

import numpy as np
import pytest
from numba import cuda, types

from pynanoqwen.ptx import rendezvous
from pynanoqwen.ptx.bulk_copy import BULK_COPY_ALIGNMENT, bulk_copy_to_shared, bulk_copy_to_shared_simulated
from pynanoqwen.ptx.mbarrier import (complete_tx_simulated, fence_barrier_init, mbarrier_arrive,
                                     mbarrier_arrive_expect_tx, mbarrier_arrive_expect_tx_simulated,
                                     mbarrier_arrive_simulated, mbarrier_init, mbarrier_init_simulated,
                                     mbarrier_try_wait_parity_simulated, mbarrier_wait)


def copy_one_tile(src, out):
    tile = cuda.shared.array(512, types.float32, alignment=BULK_COPY_ALIGNMENT)
    bars = cuda.shared.array(2, types.uint64)
    if cuda.threadIdx.x == 0:
        mbarrier_init(bars, 0, 1)
        mbarrier_init(bars, 1, cuda.blockDim.x)
        fence_barrier_init()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        mbarrier_arrive_expect_tx(bars, 0, 2048)
        bulk_copy_to_shared(tile, src[cuda.blockIdx.x], 2048, bars, 0)
    mbarrier_wait(bars, 0, 0)
    out[cuda.blockIdx.x, cuda.threadIdx.x] = tile[cuda.threadIdx.x]
    mbarrier_arrive(bars, 1)


def test_copy_primitives_compile_inline_for_sm90():
    ptx, _ = cuda.compile_ptx(copy_one_tile, "void(float32[:, ::1], float32[:, ::1])", cc=(9, 0))
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    for instruction in ("mbarrier.init.shared::cta.b64", "fence.proxy.async.shared::cta",
                        "mbarrier.arrive.expect_tx.shared::cta.b64",
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "mbarrier.try_wait.parity.shared::cta.b64", "mbarrier.arrive.shared::cta.b64"):
        assert any(instruction in line for line in code), instruction
    assert not any(line.startswith("call") for line in code)
    assert ".shared .align 128" in ptx  # the copy destination got the alignment bulk copies need


def phase_parity(bars, index):
    return int(bars[index]) >> 63


def test_mbarrier_twin_completes_a_phase_after_arrivals_and_bytes():
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 2)
    mbarrier_arrive_expect_tx_simulated(bars, 0, 4096)  # 1 of 2 arrivals, 4096 bytes owed
    complete_tx_simulated(bars, 0, 2048)
    mbarrier_arrive_simulated(bars, 0)  # arrivals done, 2048 bytes still owed
    assert phase_parity(bars, 0) == 0
    complete_tx_simulated(bars, 0, 2048)
    assert phase_parity(bars, 0) == 1
    assert mbarrier_try_wait_parity_simulated(bars, 0, 0)
    # Phase 1 is armed again with 2 arrivals.
    mbarrier_arrive_simulated(bars, 0)
    assert phase_parity(bars, 0) == 1
    mbarrier_arrive_simulated(bars, 0)
    assert phase_parity(bars, 0) == 0


def test_mbarrier_twin_rejects_extra_arrivals_and_reports_deadlock(monkeypatch):
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 1)
    mbarrier_arrive_expect_tx_simulated(bars, 0, 16)  # the phase waits for 16 bytes
    with pytest.raises(RuntimeError, match="more arrivals"):
        mbarrier_arrive_simulated(bars, 0)
    monkeypatch.setattr(rendezvous, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(rendezvous, "STUCK_SECONDS", 0.05)
    with pytest.raises(RuntimeError, match="parity 0 never completed: deadlock"):
        mbarrier_try_wait_parity_simulated(bars, 0, 0)


def test_bulk_copy_twin_lands_bytes_then_completes_the_transaction():
    rng = np.random.default_rng()
    src = rng.standard_normal((4, 256)).astype(np.float16)
    dst = np.zeros((2, 128), np.uint32)  # a uint32 view of the same 512 bytes, as the attention ring
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 1)
    mbarrier_arrive_expect_tx_simulated(bars, 0, 512)
    bulk_copy_to_shared_simulated(dst[1], src[2], 512, bars, 0)
    assert mbarrier_try_wait_parity_simulated(bars, 0, 0)
    assert np.array_equal(dst[1].view(np.float16), src[2]) and not dst[0].any()


def test_bulk_copy_twin_enforces_size_alignment_and_bounds():
    src = np.random.default_rng().standard_normal(256).astype(np.float32)
    dst = np.zeros(256, np.float32)
    bars = np.zeros(1, np.uint64)
    mbarrier_init_simulated(bars, 0, 1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        bulk_copy_to_shared_simulated(dst, src, 24, bars, 0)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        bulk_copy_to_shared_simulated(dst[1:], src, 16, bars, 0)
    with pytest.raises(RuntimeError, match="overrun"):
        bulk_copy_to_shared_simulated(dst[128:], src, 1024, bars, 0)
