"""The GPU engine: a .nanoqwen model on the device, its buffers, KV pages, schedule and CUDA graphs.

    memory.py    what it allocates, checked against the free device memory before anything is
    weights.py   the weights on the device (q/k/v packed) and the GEMVs and GEMMs over them
    buffers.py   step state, activations, the paged KV cache, the prefill rows
    schedule.py  the launches of a decode step and of a prefill chunk, the layer order written once
    capture.py   those launch lists as CUDA graphs
    backend.py   CudaBackend: reset, prefill, step, generate
    probes.py    the hooks bench, validate and the self-check call (backend.GpuEngine)
"""

from .backend import CudaBackend
from .memory import PREFILL_BUCKETS, check_free_memory, device_bytes, prefill_buckets

__all__ = ["CudaBackend", "PREFILL_BUCKETS", "check_free_memory", "device_bytes", "prefill_buckets"]
