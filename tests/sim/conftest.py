"""Every simulated thread ends with its test.

When one thread of a simulated block raises, numba-cuda's simulator reports it at once and leaves
the block's other threads to unwind on their own (ptx/rendezvous.py lets a waiting one go within
half a second). While any of them still runs, the kernel's module has the simulator's `cuda` in
place of numba's, so a test started meanwhile fails with "'FakeCUDAModule' object has no attribute
'jit'" and the report buries the one real failure under a cascade. So each test waits for them."""

import pytest

from simulated import UNWIND_SECONDS, join_simulated_threads, pause_block_polling

pause_block_polling()  # simulated.run_block_pausing says why


@pytest.fixture(autouse=True)
def simulated_threads_end_with_their_test():
    yield
    alive = join_simulated_threads(UNWIND_SECONDS)
    if alive:
        pytest.fail(f"{len(alive)} simulated threads still running {UNWIND_SECONDS} s after the test: {alive[:4]}")
