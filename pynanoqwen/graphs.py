"""CUDA graphs: record the ~200 kernel launches of a decode step once, replay them with one call.

An eager Numba launch costs ~170 us of host time; the same launch inside a graph ~1.1 us
(docs/HARDWARE.md), so a 7B step of ~200 kernels goes from ~35 ms of launch overhead to
well under a millisecond. numba-cuda has no graph API, so this module drives the CUDA driver
through `cuda.bindings.driver`:

    cuStreamBeginCapture(stream, THREAD_LOCAL)   launches on `stream` are recorded, not run
    enqueue()                                    the same Python code that eager mode runs
    cuStreamEndCapture(stream) -> CUgraph
    cuGraphInstantiate(graph, 0) -> CUgraphExec  validated and uploaded once
    cuGraphLaunch(exec, stream)                  each step

Kernel arguments are frozen at capture, which is why everything that changes from step to step
(position, token, page table, sampling parameters) lives in device memory that kernels read.
Every kernel must be compiled (launched once eagerly) before capture: compiling and loading a
module is not something to do in the middle of a capture. Every driver call's CUresult is
checked, and a failure raises CudaGraphError naming the call.
"""

from __future__ import annotations

from collections.abc import Callable

from cuda.bindings import driver as cu


class CudaGraphError(RuntimeError):
    """A CUDA driver call for a graph failed (a bug or a broken device, not a user error)."""


def check(call: str, result):
    """Unpack a cuda.bindings return value: raise CudaGraphError unless its CUresult is success."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        described = cu.cuGetErrorString(err)
        detail = described[1].decode() if described[0] == cu.CUresult.CUDA_SUCCESS else ""
        raise CudaGraphError(f"{call} failed: {getattr(err, 'name', err)} {detail}".rstrip())
    return values[0] if len(values) == 1 else tuple(values)


def stream_handle(stream) -> cu.CUstream:
    """The driver handle of a numba-cuda stream."""
    return cu.CUstream(int(stream.handle))


class CudaGraph:
    """An instantiated graph; `launch` replays it on a stream, `close` frees it."""

    def __init__(self, graph, graph_exec, kernels: int):
        self._graph = graph
        self._exec = graph_exec
        self.kernels = kernels  # nodes in the graph, for reports

    def launch(self, stream) -> None:
        check("cuGraphLaunch", cu.cuGraphLaunch(self._exec, stream_handle(stream)))

    def close(self) -> None:
        if self._exec is not None:
            check("cuGraphExecDestroy", cu.cuGraphExecDestroy(self._exec))
            check("cuGraphDestroy", cu.cuGraphDestroy(self._graph))
            self._exec = self._graph = None


def capture(stream, enqueue: Callable[[], None]) -> CudaGraph:
    """Record what `enqueue()` launches on `stream` and instantiate it as a graph."""
    handle = stream_handle(stream)
    check("cuStreamBeginCapture",
          cu.cuStreamBeginCapture(handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    try:
        enqueue()
    except BaseException:
        # Leave the stream usable: end the capture and drop the partial graph before re-raising.
        err, graph = cu.cuStreamEndCapture(handle)
        if err == cu.CUresult.CUDA_SUCCESS and graph is not None:
            cu.cuGraphDestroy(graph)
        raise
    graph = check("cuStreamEndCapture", cu.cuStreamEndCapture(handle))
    try:
        graph_exec = check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))
        _, node_count = check("cuGraphGetNodes", cu.cuGraphGetNodes(graph))  # 0: just count them
    except BaseException:
        cu.cuGraphDestroy(graph)
        raise
    return CudaGraph(graph, graph_exec, node_count)
