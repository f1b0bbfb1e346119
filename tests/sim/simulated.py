"""What the simulator tests share: launching on a stream and waiting, device scalars, and the
unit roundoffs their error bounds are written in."""

import threading
import time

import numpy as np
from numba import cuda
from numba.cuda.simulator import kernel as simulator_kernel
from numba.cuda.simulator.kernel import BlockThread

FP16_HALF_ULP = 2.0 ** -11  # relative rounding error of one conversion to float16 (normal range)
FP32_EPS = 2.0 ** -23


UNWIND_SECONDS = 300  # a thread still running this long after its test is itself a failure


def join_simulated_threads(timeout: float) -> list[str]:
    """Wait up to `timeout` s for each simulated thread still alive (a failed kernel's); the names
    of those that did not end."""
    leftovers = [t for t in threading.enumerate() if isinstance(t, BlockThread)]
    for thread in leftovers:
        thread.join(timeout)
    return [str(t) for t in leftovers if t.is_alive()]


def run(launch):
    """launch(stream), then wait for the stream."""
    stream = cuda.stream()
    launch(stream)
    stream.synchronize()


def device_int(value: int):
    """An int32 [1] device array holding value (a kernel's scalar in device memory)."""
    return cuda.to_device(np.array([value], np.int32))


POLL_PAUSE_SECONDS = 2e-4


def run_block_pausing(self, grid_point, *args):
    """numba-cuda's BlockManager.run (one simulated block: start its threads, release them from
    syncthreads once all are there, raise the first exception), with a pause in its polling loop.

    numba-cuda's loop polls without pause and so holds the interpreter lock against the very
    threads it waits for, for a whole switch interval each time it gets it: the 20 GEMV cases of
    test_gemv_exact_activations took 31 s with it, 18 s with this (2 cores, idle), and with a
    50 ms switch interval 189 s against 18 s. That dependence on who gets the lock when is what
    made tests/sim's time vary threefold between CI runs."""
    threads, live, blocked = set(), set(), set()
    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
        thread.start()
        threads.add(thread)
        live.add(thread)
    while live:
        time.sleep(POLL_PAUSE_SECONDS)  # the lock goes to the block's threads
        for thread in live:
            if thread.syncthreads_blocked:
                blocked.add(thread)
            elif thread.exception:
                for other in threads:  # abort the block, as numba-cuda does
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                raise thread.exception[0].with_traceback(thread.exception[1])
        if live == blocked:
            for thread in blocked:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
            blocked = set()
        live = {thread for thread in live if thread.is_alive()}
    for thread in threads:
        if thread.exception:
            raise thread.exception[0].with_traceback(thread.exception[1])


def pause_block_polling() -> None:
    """Put run_block_pausing in place of numba-cuda's BlockManager.run (tests/sim/conftest.py)."""
    simulator_kernel.BlockManager.run = run_block_pausing
