"""The GPU this process may run on: whether there is one the engine can use, and its sizes.

Everything that asks the device a question goes through here, so that no other module hard-codes
an SM count or a cache size (an H100 SXM and an H200 have 132 SMs, an H100 PCIe 114; the H200's
L2 is 60 MB, the H100's 50 MB). numba-cuda is imported inside the functions on purpose: a CPU-only
install may lack its CUDA libraries, and `cuda_gpu_available` must answer False there, not fail.

`library_warnings` is the one switch for the warnings numba-cuda and the CUDA bindings print while
kernels compile and launch (NumbaPerformanceWarning for the one-block kernels of a decode step,
among others): the commands hide them unless run with --verbose.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Iterator

from .errors import NanoQwenError

MIN_COMPUTE_CAPABILITY = (9, 0)  # Hopper: the kernels use wgmma, TMA bulk copies and mbarriers
STATIC_SHARED_BYTES = 48 * 1024
"""A block's shared memory without asking: all of its static arrays (cuda.shared.array) together,
and the dynamic shared memory a launch gets unless the function's limit is raised first
(launch.launch raises it)."""


def cuda_gpu_available() -> bool:
    """Whether a CUDA GPU the engine can use (compute capability 9.0 or newer) is present."""
    try:
        from numba import config, cuda
        from numba.cuda.cudadrv.error import CudaSupportError
    except ImportError:  # numba-cuda or its CUDA libraries are not installed
        return False
    # The simulator reports a device, but the engine's inline PTX cannot run on it.
    if config.ENABLE_CUDASIM:
        return False
    try:
        return bool(cuda.is_available()) and cuda.get_current_device().compute_capability >= MIN_COMPUTE_CAPABILITY
    except CudaSupportError:
        return False


def require_gpu() -> None:
    """Raise NanoQwenError unless cuda_gpu_available()."""
    if not cuda_gpu_available():
        raise NanoQwenError("no CUDA GPU with compute capability 9.0 or newer found; use --device cpu")


SIMULATED_SM_COUNT = 2  # the CUDA simulator has no SM count; 2 keeps its persistent grids small


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the current device (the grid sizes that fill it derive from it)."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return SIMULATED_SM_COUNT
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


@functools.cache
def l2_bytes() -> int:
    """Bytes of L2 cache of the current device."""
    from numba import cuda

    return int(cuda.get_current_device().L2_CACHE_SIZE)


def device_name() -> str:
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


@contextlib.contextmanager
def library_warnings(shown: bool) -> Iterator[None]:
    """Inside: the warnings of numba and numba-cuda are printed only when `shown` (--verbose).

    Scoped with warnings.catch_warnings, so importing pynanoqwen changes no process-wide filter.
    """
    with warnings.catch_warnings():
        if not shown:
            for category in _numba_warning_classes():
                warnings.simplefilter("ignore", category)
        yield


def _numba_warning_classes() -> list[type[Warning]]:
    """The base warning classes of numba and of numba-cuda (each has its own errors module)."""
    classes = []
    for module in ("numba.core.errors", "numba.cuda.core.errors"):
        try:
            classes.append(importlib.import_module(module).NumbaWarning)
        except (ImportError, AttributeError):  # numba-cuda not installed, or an older layout
            continue
    return classes
