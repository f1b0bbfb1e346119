"""Quantize the activation vector to INT8 for the dp4a GEMV path (pynanoqwen/kernels/gemv_int4.py).

For each group of 128 inputs g (the weights' group): scale[g] = max|x| / 127 and
q = round(x * (127 / max|x|)), |q| <= 127, so x ~ q * scale[g] with |error| <= scale[g] / 2.
The output is laid out for the GEMV, not in input order:

- `xq` uint32 [K/4]: four int8 per word. A weight word (8 nibbles, ValueShuffle) splits into
  `word & 0x0F0F0F0F` = weights (0, 1, 4, 5) and `(word >> 4) & 0x0F0F0F0F` = weights (2, 3, 6, 7)
  of its 8 inputs, so the activations of those 8 inputs are packed as A = (q0, q1, q4, q5) and
  B = (q2, q3, q6, q7). Chunk c (inputs 32c .. 32c+31, the 16 bytes of weights one GEMV lane loads)
  has 8 such words, j = 0..7 (A, B of its 1st octet, A, B of its 2nd, ...), stored at
  xq[j * K/32 + c]: the 32 lanes of a warp, reading chunks c .. c+31, touch 32 consecutive words,
  so their shared-memory reads hit 32 different banks.
- `offset` int32 [K/32]: 8 * sum of q over chunk c. The nibbles are u = w + 8, so
  sum (u - 8) q = dp4a-dot(u, q) - offset[c], exact in integers.
- `scale` float32 [K/128].

Launch: 256 threads per block, one thread per 8 inputs (one 16-byte load), 16 threads per group;
a group's max and a chunk's sum go through shuffles within those lanes. K/8 threads in all: this
kernel moves 2K + 1.2K bytes, noise next to the GEMV it feeds.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from ..config import GROUP_SIZE
from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.half2 import half2_to_float2
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.warp import shfl_xor
from . import CompileTarget

THREADS_PER_BLOCK = 256
OCTETS_PER_GROUP = GROUP_SIZE // 8  # threads per group: 16, half a warp


@cuda.jit(device=True, inline="always")
def pack_int8x4(b0, b1, b2, b3):
    """Four int8 values (held in ints, |v| <= 127) as the bytes of one uint32, b0 lowest."""
    return (uint32(b0 & 0xFF) | uint32(b1 & 0xFF) << uint32(8)
            | uint32(b2 & 0xFF) << uint32(16) | uint32(b3 & 0xFF) << uint32(24))


@functools.cache
def quantize_activation_kernel(k: int):
    """The kernel for input length k: quantize(x_pairs uint32 [k/2] (x as half2), xq, scale, offset)."""
    octets = k // 8
    chunks = k // 32

    @cuda.jit
    def quantize_activation_int8(x_pairs, xq, scale, offset):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        octet = cuda.blockIdx.x * THREADS_PER_BLOCK + cuda.threadIdx.x
        active = octet < octets
        # Every lane runs the shuffles below (they need the whole warp); lanes past the end of x
        # take part with zeros and store nothing.
        x = cuda.local.array(8, float32)
        for i in range(8):
            x[i] = float32(0)
        if active:
            p0, p1, p2, p3 = ld_global_nc_v4_u32(x_pairs, 4 * octet)
            x[0], x[1] = half2_to_float2(p0)
            x[2], x[3] = half2_to_float2(p1)
            x[4], x[5] = half2_to_float2(p2)
            x[6], x[7] = half2_to_float2(p3)
        largest = float32(0)
        for i in range(8):
            largest = max(largest, abs(x[i]))
        largest = max(largest, shfl_xor(largest, 8))  # the 16 lanes of this group
        largest = max(largest, shfl_xor(largest, 4))
        largest = max(largest, shfl_xor(largest, 2))
        largest = max(largest, shfl_xor(largest, 1))
        inverse = float32(127) / largest if largest > 0 else float32(0)
        q = cuda.local.array(8, int32)
        total = 0
        for i in range(8):
            q[i] = int32(round(x[i] * inverse))
            total += q[i]
        total = int32(total)  # Numba widens int arithmetic to int64; a shuffle moves 32 bits
        total = int32(total + shfl_xor(total, 1))  # the 4 lanes of this chunk
        total = int32(total + shfl_xor(total, 2))
        if active:
            chunk = octet // 4
            first = 2 * (octet % 4)  # this octet's A and B are words 2o, 2o+1 of its chunk
            xq[first * chunks + chunk] = pack_int8x4(q[0], q[1], q[4], q[5])
            xq[(first + 1) * chunks + chunk] = pack_int8x4(q[2], q[3], q[6], q[7])
            if octet % 4 == 0:
                offset[chunk] = 8 * total
            if octet % OCTETS_PER_GROUP == 0:
                scale[octet // OCTETS_PER_GROUP] = largest / float32(127)

    return quantize_activation_int8


class Int8Activations:
    """The dp4a path's workspace for one input length K and the kernel that fills it.

    Allocated once (K + K/8 + K/32 bytes); `launch` quantizes a float16 [K] vector into it.
    """

    def __init__(self, k: int):
        if k % GROUP_SIZE:
            raise ValueError(f"input length {k} is not a multiple of the group size {GROUP_SIZE}")
        self.k = k
        self.xq = cuda.device_array(k // 4, dtype=np.uint32)
        self.scale = cuda.device_array(k // GROUP_SIZE, dtype=np.float32)
        self.offset = cuda.device_array(k // 32, dtype=np.int32)
        self._kernel = quantize_activation_kernel(k)
        self._grid = -(-(k // 8) // THREADS_PER_BLOCK)

    def launch(self, stream, x_pairs) -> None:
        """Quantize x (float16 [K], passed as its uint32 [K/2] view) into xq, scale, offset."""
        launch(self._kernel, self._grid, THREADS_PER_BLOCK, stream, (x_pairs, self.xq, self.scale, self.offset))


def compile_targets() -> list[CompileTarget]:
    """The quantizer at the 7B input lengths (hidden 3584, intermediate 18944) and a tiny one."""
    signature = "void(uint32[::1], uint32[::1], float32[::1], int32[::1])"
    return [CompileTarget(f"quantize_activation_int8[k={k}]", quantize_activation_kernel(k), signature,
                          must_contain=("ld.global.nc.v4.u32", "shfl.sync.bfly.b32"))
            for k in (256, 3584, 18944)]
