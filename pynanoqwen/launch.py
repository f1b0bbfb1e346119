"""Kernel launches with programmatic dependent launch (PDL), which numba-cuda's `kernel[grid, block]`
syntax cannot ask for.

A decode step is ~170 dependent kernels. Launched plainly, kernel i + 1 starts only after kernel i
has completed and its memory is flushed: every boundary costs the launch latency plus a ramp in
which no weight bytes flow (docs/DECODE.md measures it). Launched with the programmatic-stream-
serialization attribute, kernel i + 1 may start as soon as every block of kernel i has executed
`griddepcontrol.launch_dependents` (ptx/griddep.py), and it waits with `griddepcontrol.wait` only
where it reads what kernel i wrote; captured into a CUDA graph the edge stays programmatic.

`launch(kernel, grid, block, stream, args, shared_bytes=0)` does what numba-cuda's own
`_Kernel.launch` does (specialise the dispatcher for the argument types, flatten each argument into
the kernel's parameters) and then calls cuda.core's `launch` with
`LaunchConfig(programmatic_stream_serialization=True)`. It uses two numba-cuda internals,
`_Kernel._prepare_args` and `_Kernel._codelibrary`, which is why pyproject.toml pins numba-cuda's
minor version. Every kernel launched this way must call `grid_dependency_wait()` before it reads
another kernel's output or writes memory another kernel reads; the kernels of the decode step do,
but for what decode attention and the GEMVs' epilogues read before their wait, which is older than
the kernel before them (docs/DECODE.md, "Execution model").

Under the CUDA simulator (no driver) it falls back to the plain launch.
"""

from __future__ import annotations

import contextlib

from cuda.core import LaunchConfig
from cuda.core import launch as core_launch
from numba.cuda.cudadrv import driver

from . import kernel_cache
from .device import STATIC_SHARED_BYTES
from .ptx import SIMULATOR

_programmatic = [True]  # plain_launches() turns PDL off for a comparison (bench)


@contextlib.contextmanager
def plain_launches():
    """Inside this block every launch() is a plain stream-ordered launch (no PDL): what bench
    compares the programmatic decode step against. Graphs captured inside keep plain edges."""
    _programmatic[0] = False
    try:
        yield
    finally:
        _programmatic[0] = True


def _specialization(dispatcher, args):
    """numba-cuda's compiled kernel (`_Kernel`) of `dispatcher` for these arguments' types: from
    this process, from the disk cache (kernel_cache.py), or compiled now."""
    types = tuple(dispatcher.typeof_pyval(a) for a in args)
    kernel = dispatcher.overloads.get(types)
    if kernel is not None:
        return kernel
    kernel_cache.attach(dispatcher)
    return dispatcher.compile(types)


_raised_limits: set = set()  # compiled kernels whose dynamic shared-memory limit is raised already


def _allow_dynamic_shared(kernel, nbytes: int) -> None:
    """Let a compiled kernel take `nbytes` of dynamic shared memory
    (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); once per kernel, as every launch of one
    build asks for the same amount."""
    if kernel in _raised_limits:
        return
    function = kernel._codelibrary.get_cufunc()
    attribute = driver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.driver.cuKernelSetAttribute(attribute, nbytes, function.handle, function.device.id)
    _raised_limits.add(kernel)


def launch(dispatcher, grid, block, stream, args, shared_bytes: int = 0, dependent: bool = True,
           cluster: tuple[int, int] | None = None) -> None:
    """Launch `dispatcher` (a `cuda.jit` kernel) on `stream` with `shared_bytes` of dynamic shared
    memory; with `dependent`, as a programmatic dependent of the previous launch on the stream
    (the kernel must call grid_dependency_wait); with `cluster` (blocks in x, y), in thread-block
    clusters of that shape (grid, in blocks, a multiple of it)."""
    if SIMULATOR:
        if cluster is not None:
            raise RuntimeError("the CUDA simulator has no thread-block clusters")
        dispatcher[grid, block, stream, shared_bytes](*args)
        return
    kernel = _specialization(dispatcher, args)
    if shared_bytes > STATIC_SHARED_BYTES:
        _allow_dynamic_shared(kernel, shared_bytes)
    if cluster is None and (not dependent or not _programmatic[0]):
        dispatcher[grid, block, stream, shared_bytes](*args)
        return
    core_stream = driver._to_core_stream(stream)
    parameters: list = []
    write_backs: list = []
    for argument_type, value in zip(kernel.argument_types, args):
        kernel._prepare_args(argument_type, value, core_stream, write_backs, parameters)
    if cluster is None:
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes, programmatic_stream_serialization=True)
    else:  # cuda.core counts the grid in clusters when a cluster shape is given
        config = LaunchConfig(grid=(grid[0] // cluster[0], grid[1] // cluster[1]), cluster=cluster, block=block,
                              shmem_size=shared_bytes, programmatic_stream_serialization=dependent and _programmatic[0])
    core_launch(core_stream, config, kernel._codelibrary.get_cufunc().kernel, *parameters)
