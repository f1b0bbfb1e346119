"""The CUDA kernels of one decode step, one module per operation, and the registry of their builds.

Every kernel module exposes `compile_targets()`: the kernels it builds, each at the shapes that
matter (the 7B model's and a tiny one), with the PTX instructions it is built around.
tests/test_kernels_compile.py compiles every target for sm_90 with `numba.cuda.compile_ptx`,
checks those instructions appear inline, checks hot kernels contain no `call` and no local
memory, and assembles the PTX for sm_90 (ptxas through nvJitLink, verbose) to check for register
spills. To register a new kernel module, add its name to KERNEL_MODULES.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

PAGE_SIZE = 16
"""Positions per KV page (docs/DECODE.md): one (page, kv head) tile is PAGE_SIZE x head_dim FP16
values, position p lives in page page_table[p // PAGE_SIZE], slot p % PAGE_SIZE."""

GEMV_PATHS = ("auto", "prmt", "dp4a")
"""What `--gemv` chooses for the INT4 GEMVs (gemv_int4.py): auto (the default) gives each linear the
path measured faster at its shape (kernel_path: fixed16, or prmt for a long K); prmt or
dp4a (INT8 activations, the seed's Path A, kept so the benchmark can compare) everywhere."""


LONG_K = 8192
"""An input length from which staging x costs every GEMV block enough to change its plan
(gemv_int4.default_plan) and its path (kernel_path): down_proj's 18944, not the 3584 of the rest."""


def kernel_path(gemv: str, k: int) -> str:
    """The arithmetic path (gemv_int4.PATHS) a GEMV of input length k runs under `--gemv gemv`: auto
    takes the faster at each 7B shape (docs/PERFORMANCE.md, "Decode, 2026-12-04 night"). fixed16
    needs about half the instructions a weight, but every block quantizes all of x while staging
    it; at K 18944 (down_proj) that costs more than the cheaper arithmetic saves, so a long K
    keeps prmt."""
    if gemv != "auto":
        return gemv
    return "prmt" if k >= LONG_K else "fixed16"

KERNEL_MODULES = ("gemv_int4", "quantize_activation", "gemv_fp16", "embedding", "rmsnorm", "rope_kv_write",
                  "attention_decode", "attention_prefill", "page_alloc", "sampling", "gemm_int4", "gemm_int4_tma", "embedding_prefill",
                  "page_alloc_prefill", "last_row_prefill")


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """One kernel build to check: `kernel` is a `cuda.jit` dispatcher (or its Python function)."""

    name: str
    kernel: object
    signature: str | object  # a Numba signature, as a string or a numba.core.typing.Signature
    must_contain: tuple[str, ...] = ()  # PTX instruction texts that must appear inline
    hot: bool = True  # on the per-token path: no `call` allowed in its PTX
    cc: tuple = (9, 0)  # (9, 0, "a") for sm_90a-only instructions (wgmma), as numba-cuda compiles on an H100/H200

    @property
    def py_func(self):
        return getattr(self.kernel, "py_func", self.kernel)


def on_device(array, dtype):
    """A device array of `dtype`: a numpy array is copied over (contiguous, converted), a device
    array is taken as it is if it already has that dtype."""
    from numba import cuda

    array = cuda.to_device(np.ascontiguousarray(array, dtype=dtype)) if isinstance(array, np.ndarray) else array
    if array.dtype != np.dtype(dtype):
        raise TypeError(f"expected a {np.dtype(dtype)} array, got {array.dtype}")
    return array


def all_compile_targets() -> list[CompileTarget]:
    """The compile targets of every module in KERNEL_MODULES, in that order."""
    targets = []
    for module in KERNEL_MODULES:
        targets.extend(importlib.import_module(f"{__name__}.{module}").compile_targets())
    return targets
