"""What the simulator tests share: launching on a stream and waiting, device scalars, and the
unit roundoffs their error bounds are written in."""

import numpy as np
from numba import cuda

FP16_HALF_ULP = 2.0 ** -11  # relative rounding error of one conversion to float16 (normal range)
FP32_EPS = 2.0 ** -23


def run(launch):
    """launch(stream), then wait for the stream."""
    stream = cuda.stream()
    launch(stream)
    stream.synchronize()


def device_int(value: int):
    """An int32 [1] device array holding value (a kernel's scalar in device memory)."""
    return cuda.to_device(np.array([value], np.int32))
