"""Device functions both sampling methods share (kernels/sampling.py owns what they compute): the
counter-based uniform, the order of (logit, id) pairs, block-wide reductions and the
compare-exchange of the sorting networks."""

from __future__ import annotations

import math

from numba import cuda, float32, int32, uint64

from ..ptx.warp import shfl_xor, warp_sum

NO_ID = 2**31 - 1          # an id worse than any real one, for "nothing seen yet"


@cuda.jit(device=True, inline="always")
def splitmix64(z):
    """The finaliser of splitmix64: a bijective mix of a uint64 whose output bits look random."""
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


@cuda.jit(device=True, inline="always")
def uniform(seed, position, index):
    """A float32 in (0, 1), a function of (seed, position, index) only: 23 hashed bits + 1/2 ulp."""
    counter = (uint64(position) << uint64(32)) | uint64(index)
    z = splitmix64(seed ^ splitmix64(counter))
    return (float32(z >> uint64(41)) + float32(0.5)) * float32(1.0 / 8388608.0)


@cuda.jit(device=True, inline="always")
def better(value, index, other_value, other_index):
    """Whether (other_value, other_index) ranks before (value, index): larger logit, then lower id."""
    return other_value > value or (other_value == value and other_index < index)


@cuda.jit(device=True, inline="always")
def take_better_from_lane(value, index, lane_mask):
    other_value = shfl_xor(value, lane_mask)
    other_index = shfl_xor(index, lane_mask)
    if better(value, index, other_value, other_index):
        return other_value, other_index
    return value, index


@cuda.jit(device=True, inline="always")
def warp_argmax(value, index):
    """The best (value, index) of the warp, in every lane (ties resolve the same way in each)."""
    value, index = take_better_from_lane(value, index, 16)
    value, index = take_better_from_lane(value, index, 8)
    value, index = take_better_from_lane(value, index, 4)
    value, index = take_better_from_lane(value, index, 2)
    value, index = take_better_from_lane(value, index, 1)
    return value, index


@cuda.jit(device=True, inline="always")
def block_argmax(value, index, warp_values, warp_indices, warps):
    """The best (value, index) of the block, in every thread; warp_* are 32-slot shared arrays."""
    lane = cuda.threadIdx.x % 32
    value, index = warp_argmax(value, index)
    if lane == 0:
        warp_values[cuda.threadIdx.x // 32] = value
        warp_indices[cuda.threadIdx.x // 32] = index
    cuda.syncthreads()
    if lane < warps:
        value, index = warp_values[lane], warp_indices[lane]
    else:
        value, index = float32(-math.inf), int32(NO_ID)
    return warp_argmax(value, index)


@cuda.jit(device=True, inline="always")
def block_sum(value, warp_totals, warps):
    """Sum of float32 `value` over the block, in every thread; warp_totals is 32-slot shared."""
    value = warp_sum(value)
    if cuda.threadIdx.x % 32 == 0:
        warp_totals[cuda.threadIdx.x // 32] = value
    cuda.syncthreads()
    lane = cuda.threadIdx.x % 32
    value = warp_totals[lane] if lane < warps else float32(0.0)
    value = warp_sum(value)
    cuda.syncthreads()  # every warp has read warp_totals before anyone may reuse it
    return value


@cuda.jit(device=True, inline="always")
def order_pair(values, indices, i, j, best_first):
    """Compare-exchange: afterwards (i, j) is in best-first order if best_first, else the reverse."""
    vi, ii, vj, ij = values[i], indices[i], values[j], indices[j]
    if better(vi, ii, vj, ij) == best_first:
        values[i], indices[i], values[j], indices[j] = vj, ij, vi, ii
