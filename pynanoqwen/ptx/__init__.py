"""Hand-written PTX primitives for the kernels, each with a CUDA-simulator twin.

Numba-CUDA has no Python spelling for some instructions the kernels are built around (`prmt.b32`,
16-byte `ld.global.nc.v4`, `dp4a`, `fma.rn.f16x2`, cp.async.bulk, mbarrier, mma, wgmma). Each one lives here
as one small `numba.cuda.extending.intrinsic` whose body is a single `llvmlite.ir.InlineAsm`
string, the way numba-cuda's own `cache_hints.py` is written; the docstring says what it does and
which section of the PTX ISA it comes from. One module per instruction family:

    prmt.py   prmt.b32 byte permute                       (PTX ISA, Data Movement: prmt)
    loads.py  ld.global.nc.v4.u32 16-byte read-only load, ld.global.cg (L2 only), st.global.v4.f32
              (PTX ISA: ld, st)
    dp4a.py   dp4a four-way byte dot products, signed and unsigned (PTX ISA, Integer Arithmetic: dp4a)
    bits.py   mov.b32 between float32 and integer registers (PTX ISA, Data Movement: mov)
    fma.py    fma.rn.f32, rounded once (PTX ISA, Floating Point: fma): numba's cuda.fma, whose
              simulated form rounds twice
    half2.py  fma.rn.f16x2, half2 -> float32 unpack       (PTX ISA, Half Precision: fma; cvt)
    warp.py   shfl.sync.bfly.b32, warp sum / max, bar.warp.sync (PTX ISA: shfl.sync, bar.warp.sync)
    bulk_copy.py, mbarrier.py: the attention kernel's TMA copies (owned by the attention author).
    mma.py    mma.sync m16n8k16, ldmatrix, ld.shared.v4, cp.async: the tensor-core GEMM's feed
    wgmma.py  wgmma.mma_async (A in registers, B by a swizzled shared-memory descriptor), its
              fences and waits: the prefill GEMM on Hopper (sm_90a)
    tensor_copy.py cp.async.bulk.tensor 2-D boxes through tensor maps (TMA), the maps' encoding and
              their proxy fence: the prefill GEMM's feed from 512 tokens
    griddep.py griddepcontrol.wait / launch_dependents: programmatic dependent launch (launch.py)
    rendezvous.py how the twins of the cooperative instructions and of mbarrier waits meet other
              simulated threads, and when a simulated wait is a deadlock (simulator only)

How a primitive gets its simulator twin
--------------------------------------
The CUDA simulator (`NUMBA_ENABLE_CUDASIM=1`) runs kernels as plain Python, one Python thread per
CUDA thread; it cannot execute inline PTX. So each module defines, side by side,

    def prmt_simulated(a, b, selector): ...         # plain Python, identical semantics
    @simulator_twin(prmt_simulated)
    @intrinsic
    def prmt(typingctx, a, b, selector): ...         # the InlineAsm version

and `simulator_twin` returns the intrinsic normally and the Python function when the simulator is
on. Kernels import the name (`from pynanoqwen.ptx.prmt import prmt`) and never know which one they
got. Device functions built only from primitives (warp_sum, the GEMV inner step) need no twin: the
simulator runs their Python source, which calls the simulated primitives.

The twins of prmt, loads, dp4a, bits, fma, half2 and warp are public (`prmt_simulated`, ...) and callable
from ordinary Python, which is how tests/test_ptx.py checks them against numpy (quant.prmt) and
hand-written arithmetic.
"""

from __future__ import annotations

from numba.cuda.core import config as _numba_cuda_config

SIMULATOR: bool = bool(_numba_cuda_config.ENABLE_CUDASIM)
"""True when numba-cuda runs kernels in its CPU simulator; fixed for the life of the process."""


def simulator_twin(simulated):
    """Decorator: keep the GPU intrinsic, or swap in `simulated` when the CUDA simulator is on.

    The simulated function takes the same arguments as the intrinsic does inside a kernel (not the
    `typingctx` the intrinsic's Python definition takes) and returns what the instruction returns.
    """

    def choose(intrinsic_version):
        return simulated if SIMULATOR else intrinsic_version

    return choose
