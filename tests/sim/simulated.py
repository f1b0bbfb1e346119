"""What the simulator tests share: launching on a stream and waiting, device scalars, and the
unit roundoffs their error bounds are written in."""

import threading

import numpy as np
from numba import cuda
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
