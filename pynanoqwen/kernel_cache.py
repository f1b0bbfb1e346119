"""Compiled kernels kept on disk between processes, so a second start skips the compiler.

Why. Every kernel is built per model shape (dims are compile-time constants), and a process
compiles each one it launches on first use: Numba to PTX, then a cubin; PTX and ptxas take 3.5-4.7
s a prefill kernel on the 2-core development machine (tests/test_kernels_compile.py). `serve` on a
7B file spends 55-57 s preparing its prefill graphs before it answers (docs/PERFORMANCE.md,
2026-12-06, evening; how much of that is compiling was not measured apart), and `generate`,
`bench` and the GPU tests compile at every start.

What. `attach` gives a dispatcher a `KernelCache` before its first compile: `launch.launch`, which
every kernel of the package goes through, attaches on a compile miss. Numba asks it for a
compiled kernel (`load_overload`) before compiling, and hands it what it compiled
(`save_overload`): the duck-typed protocol of numba-cuda's own disk cache, whose key cannot serve
here. Numba keys a kernel by its bytecode and the pickled contents of its closure, and pickling a
device function in a closure writes its dispatcher's per-process random uuid: every kernel built
by a factory (all of ours) would miss in every new process. This cache's key is instead:
- everything that can change the generated code beyond the kernel itself: the source of every
  module of this package (a kernel's globals and device functions live anywhere in it), the
  versions of numba, numba-cuda, llvmlite and the CUDA wheels, numba's optimisation level,
  debug-info default and NRT switch, and the GPU (name, compute capability, SM count), hashed
  once a process (`environment_digest`);
- the kernel: its module, qualified name, line and bytecode (kernels defined outside this package,
  such as dev/'s variants, are not cached), its target options, and its closure's values,
  described recursively (`describe`: numbers, strings, tuples, numpy values, numba types, and the
  device functions it calls, as the kernel itself); a value it cannot describe leaves that kernel
  compiling as before rather than risk a wrong hit;
- the argument types.
A file per (kernel, argument types), named by the key's hash, holds numba's own serialised kernel
(PTX and cubin), written to a temporary name and renamed into place. A file that cannot be read or
written costs a compile, never the run. tests/test_kernel_cache.py's GPU test prints a cold and a
warm start's seconds (docs/PERFORMANCE.md, "2026-12-06, morning": what it saved there).

Where: $PYNANOQWEN_KERNEL_CACHE, else $XDG_CACHE_HOME/pynanoqwen/kernels, else
~/.cache/pynanoqwen/kernels; PYNANOQWEN_KERNEL_CACHE=off compiles everything afresh. Nothing
removes old files: a new version of the package writes new names beside them, and deleting the
directory is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import types as pytypes
from pathlib import Path

import numpy as np

CACHE_ENV = "PYNANOQWEN_KERNEL_CACHE"
PACKAGE = Path(__file__).resolve().parent
# Distributions whose versions change the code a kernel compiles to.
TOOLCHAIN_PREFIXES = ("numba", "llvmlite", "cuda-", "nvidia-")


class Uncacheable(Exception):
    """A closure value that `describe` cannot name stably across processes."""


def cache_directory() -> Path | None:
    """The cache's directory, or None when PYNANOQWEN_KERNEL_CACHE=off."""
    chosen = os.environ.get(CACHE_ENV, "")
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pynanoqwen" / "kernels"


def describe(value) -> str:
    """A description of a kernel's closure value that is the same in every process that builds the
    same kernel, and differs wherever the generated code could (Uncacheable otherwise)."""
    from numba.core import types as nbtypes
    from numba.cuda.dispatcher import CUDADispatcher

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (np.generic, np.dtype)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, np.ndarray):
        return f"ndarray:{value.dtype}:{value.shape}:{hashlib.sha256(np.ascontiguousarray(value)).hexdigest()}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(describe(v) for v in value) + ")"
    if isinstance(value, nbtypes.Type):
        return f"numba-type:{value}"
    if isinstance(value, CUDADispatcher):
        return "device-function:" + describe(value.py_func) + repr(sorted(value.targetoptions.items()))
    if isinstance(value, pytypes.FunctionType):
        if not value.__module__.startswith(__package__ + "."):
            # Its source is not in environment_digest: a kernel made elsewhere (dev/'s variants,
            # a test's) could change under the same name and closure.
            raise Uncacheable(f"{value.__module__}.{value.__qualname__}, outside {__package__}")
        # Its line and bytecode too: two lambdas of one scope share a qualified name.
        code = value.__code__
        cells = tuple(cell.cell_contents for cell in value.__closure__ or ())
        return (f"function:{value.__module__}.{value.__qualname__}@{code.co_firstlineno}:"
                f"{hashlib.sha256(code.co_code).hexdigest()[:16]}" + describe(cells))
    if isinstance(value, (type, pytypes.ModuleType)) or callable(value) and hasattr(value, "__qualname__"):
        return f"named:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}"
    raise Uncacheable(f"{type(value).__module__}.{type(value).__qualname__}")


@functools.cache
def environment_digest() -> str:
    """The hash of what every kernel's code depends on besides itself (module docstring)."""
    from numba.core import config
    from numba.cuda import get_current_device

    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    versions = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                      if (d.metadata["Name"] or "").lower().startswith(TOOLCHAIN_PREFIXES))
    device = get_current_device()
    settings = (config.OPT, config.CUDA_DEBUGINFO_DEFAULT, config.CUDA_ENABLE_NRT)  # numba's that change code
    digest.update(repr((versions, settings, device.name, device.compute_capability,
                        device.MULTIPROCESSOR_COUNT)).encode())
    return digest.hexdigest()


class KernelCache:
    """One dispatcher's compiled kernels on disk, in numba-cuda's dispatcher-cache protocol. The
    key is worked out at the first load, on the GPU: building the object needs no device."""

    def __init__(self, directory: Path, dispatcher):
        self.directory, self.dispatcher = directory, dispatcher

    @property
    def cache_path(self) -> str:
        """The directory (the dispatcher's `stats` report it)."""
        return str(self.directory)

    def flush(self) -> None:
        """Nothing to forget (the dispatcher's recompile() calls it): files are named by content."""

    @functools.cached_property
    def prefix(self) -> str | None:
        """The key's part that is the same for every argument type (None: this kernel is uncached)."""
        try:
            return (environment_digest() + describe(self.dispatcher.py_func)
                    + repr(sorted(self.dispatcher.targetoptions.items())))
        except Uncacheable:
            return None

    def path(self, signature) -> Path | None:
        if self.prefix is None:
            return None
        return self.directory / (hashlib.sha256((self.prefix + str(signature)).encode()).hexdigest() + ".kernel")

    def load_overload(self, signature, target_context):
        from numba.cuda import utils
        from numba.cuda.dispatcher import _Kernel

        try:
            # As numba-cuda's own cache loads: unpickled and rebuilt with the CUDA target current.
            with utils.numba_target_override():
                return _Kernel._rebuild(**pickle.loads(self.path(signature).read_bytes()))
        except Exception:  # uncached, absent, truncated or unreadable: compile instead
            return None

    def save_overload(self, signature, kernel) -> None:
        from numba.cuda.serialize import dumps

        partial = None
        try:
            path = self.path(signature)
            if path is None:
                return
            data = dumps(kernel._reduce_states())
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".partial", delete=False) as f:
                partial = Path(f.name)
                f.write(data)
            os.replace(partial, path)
        except Exception:  # a full or read-only disk costs the next process a compile, not this one its run
            if partial is not None:
                partial.unlink(missing_ok=True)


def attach(dispatcher):
    """Give `dispatcher` (a `cuda.jit` kernel) this cache before its first compile, and return it:
    every later compile of it, by any launch path, goes through the cache. launch.launch attaches
    each kernel it compiles. Once a dispatcher; nothing under the CUDA simulator or when the cache
    is off."""
    from .ptx import SIMULATOR

    if SIMULATOR or isinstance(getattr(dispatcher, "_cache", None), KernelCache):
        return dispatcher
    directory = cache_directory()
    if directory is not None:
        dispatcher._cache = KernelCache(directory, dispatcher)
    return dispatcher
