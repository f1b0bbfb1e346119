"""The "candidates" sampling method's kernels (top-k and/or top-p; kernels/sampling.py owns what
they compute and the Sampler that launches them): per slice a bitonic sort that keeps its top
`candidates`, a two-level merge of the sorted lists in shared memory, and the draw."""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.warp import shfl_xor
from .sampling_device import better, block_sum, order_pair, uniform

MERGE_GROUP = 16           # sorted lists one candidates_merge block merges: 32 KiB of shared memory
WARP_PAIRS_SHIFT = 6       # a warp's 32 threads hold 2^6 pairs of the sort, two each


def merge_groups_of(lists: int) -> tuple[int, int]:
    """(lists a candidates_merge block merges, blocks of candidates_merge): the second is how many
    lists candidates_select merges, at most MERGE_GROUP too (its shared memory)."""
    group = min(MERGE_GROUP, lists)
    if lists // group > MERGE_GROUP:
        raise ValueError(f"{lists} candidate lists are more than {MERGE_GROUP}^2 (a larger sort_size would do)")
    return group, lists // group


@functools.cache
def candidate_kernels(vocab_size: int, candidates: int, sort_size: int, lists: int):
    threads = sort_size // 2  # one compare-exchange per thread per sorting stage
    warps = threads // 32
    chunk = -(-vocab_size // lists)
    valid = min(candidates, vocab_size)  # candidates that are real logits, not padding
    candidate_shift = candidates.bit_length() - 1  # candidates = 1 << candidate_shift
    group, groups = merge_groups_of(lists)
    group_pairs, top_pairs = group * candidates, groups * candidates  # shared-array sizes: constants
    register_halves = WARP_PAIRS_SHIFT if candidates >= 1 << WARP_PAIRS_SHIFT else 0

    @cuda.jit(device=True, inline="always")
    def lane_stage(value, index, lane_mask, keep_better):
        """One compare-exchange across lanes: this lane's pair partner is in lane ^ lane_mask; it
        keeps the better of the two if keep_better, else the worse (its partner the other)."""
        other_value = shfl_xor(value, lane_mask)
        other_index = shfl_xor(index, lane_mask)
        if better(value, index, other_value, other_index) == keep_better:
            return other_value, other_index
        return value, index

    @cuda.jit(device=True, inline="always")
    def lane_stages(v0, i0, v1, i1, t, stride_shift, best_first):
        """The stages of strides 2^stride_shift down to 1 (at most 32) on pairs 2t and 2t + 1,
        which thread t holds: pair 2t + j meets 2t + j ^ stride in lane ^ stride / 2, and at
        stride 1 its neighbour in this thread. Returns the four registers."""
        while stride_shift >= 1:
            # The lower of a pair keeps the better of the two in a best-first run, the worse otherwise.
            keep_better = ((t >> (stride_shift - 1)) & 1 == 0) == best_first
            v0, i0 = lane_stage(v0, i0, 1 << (stride_shift - 1), keep_better)
            v1, i1 = lane_stage(v1, i1, 1 << (stride_shift - 1), keep_better)
            stride_shift -= 1
        if better(v0, i0, v1, i1) == best_first:
            v0, i0, v1, i1 = v1, i1, v0, i0
        return v0, i0, v1, i1

    @cuda.jit(device=True, inline="always")
    def bitonic_sort(values, indices):
        """Sort sort_size (value, index) pairs in shared memory, best first (Batcher's network).
        Thread t holds pairs 2t and 2t + 1 in registers, so a warp holds 64 in a row: the stages
        of strides 1-32 (51 of the 66 at sort_size 2048) run in registers and shuffles with no
        block barrier; only strides of 64 and more go through shared memory, a barrier each.
        Strides are powers of two held as shifts: `t // stride` by a stride known only at run
        time is a 64-bit division, tens of instructions beside a compare-exchange's few."""
        t = cuda.threadIdx.x
        v0, i0, v1, i1 = values[2 * t], indices[2 * t], values[2 * t + 1], indices[2 * t + 1]
        size_shift = 1
        while (1 << size_shift) <= sort_size:
            stride_shift = size_shift - 1
            if stride_shift >= WARP_PAIRS_SHIFT:  # partners in other warps: through shared memory
                values[2 * t], indices[2 * t], values[2 * t + 1], indices[2 * t + 1] = v0, i0, v1, i1
                cuda.syncthreads()
                while stride_shift >= WARP_PAIRS_SHIFT:
                    i = ((t >> stride_shift) << (stride_shift + 1)) | (t & ((1 << stride_shift) - 1))
                    order_pair(values, indices, i, i + (1 << stride_shift), (i >> size_shift) & 1 == 0)
                    cuda.syncthreads()
                    stride_shift -= 1
                v0, i0, v1, i1 = values[2 * t], indices[2 * t], values[2 * t + 1], indices[2 * t + 1]
            v0, i0, v1, i1 = lane_stages(v0, i0, v1, i1, t, stride_shift, ((2 * t) >> size_shift) & 1 == 0)
            size_shift += 1
        values[2 * t], indices[2 * t], values[2 * t + 1], indices[2 * t + 1] = v0, i0, v1, i1
        cuda.syncthreads()

    def merge_network(count: int):
        """A device function that merges `count` (a power of two) sorted lists of `candidates`
        (value, index) pairs, held one after another in `values`/`indices` (shared memory), until
        list 0 holds the top `candidates` of all, in order. Round `width`: list a = 2 * width *
        pair absorbs list a + width: max(A[e], B[last - e]) holds the top of A and B as a bitonic
        sequence, which log2(candidates) half-cleaner stages put in order: those of half strides
        64 and more through shared memory, the rest in registers and shuffles (a warp's 64 pairs
        lie in one list when candidates >= 64; smaller lists, the simulator's, take shared memory
        throughout). Widths and halves are powers of two held as shifts (no run-time division)."""

        @cuda.jit(device=True, inline="always")
        def merge(values, indices):
            tid = cuda.threadIdx.x
            width_shift = 0
            while (1 << width_shift) < count:
                width = 1 << width_shift
                pairs = count >> (width_shift + 1)
                for t in range(tid, pairs * candidates, threads):
                    first = (t // candidates) * 2 * width  # list a; list b is first + width
                    a = first * candidates + t % candidates
                    b = (first + width) * candidates + candidates - 1 - t % candidates
                    if better(values[a], indices[a], values[b], indices[b]):
                        values[a] = values[b]
                        indices[a] = indices[b]
                cuda.syncthreads()
                half_shift = candidate_shift - 1
                while half_shift >= register_halves:
                    for t in range(tid, pairs * (candidates // 2), threads):
                        e = t % (candidates // 2)
                        i = ((t // (candidates // 2)) * 2 * width * candidates + ((e >> half_shift) << (half_shift + 1))
                             + (e & ((1 << half_shift) - 1)))
                        order_pair(values, indices, i, i + (1 << half_shift), True)
                    cuda.syncthreads()
                    half_shift -= 1
                if register_halves:  # the half strides below 64: two pairs a thread, as bitonic_sort
                    for t in range(tid, pairs * (candidates // 2), threads):
                        at = (t // (candidates // 2)) * 2 * width * candidates + 2 * (t % (candidates // 2))
                        v0, i0, v1, i1 = lane_stages(values[at], indices[at], values[at + 1], indices[at + 1], t,
                                                     register_halves - 1, True)
                        values[at], indices[at], values[at + 1], indices[at + 1] = v0, i0, v1, i1
                    cuda.syncthreads()
                width_shift += 1

        return merge

    merge_group, merge_groups = merge_network(group), merge_network(groups)

    @cuda.jit
    def candidates_partial(logits, sampling, candidate_values, candidate_indices, slice_max, slice_sum):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        values = cuda.shared.array(sort_size, float32)
        indices = cuda.shared.array(sort_size, int32)
        warp_totals = cuda.shared.array(32, float32)
        block = cuda.blockIdx.x
        start = block * chunk
        for t in range(cuda.threadIdx.x, sort_size, threads):
            if t < chunk and start + t < vocab_size:
                values[t] = logits[start + t]
                indices[t] = start + t
            else:  # padding ranks after every logit; its id is unique and >= vocab_size
                values[t] = -math.inf
                indices[t] = vocab_size + block * sort_size + t
        cuda.syncthreads()
        bitonic_sort(values, indices)
        for t in range(cuda.threadIdx.x, candidates, threads):
            candidate_values[block * candidates + t] = values[t]
            candidate_indices[block * candidates + t] = indices[t]
        # This slice's share of the softmax normaliser, relative to its own max (values[0]).
        inv_temperature = sampling[0]
        total = float32(0.0)
        for t in range(cuda.threadIdx.x, sort_size, threads):
            if indices[t] < vocab_size:
                total += math.exp((values[t] - values[0]) * inv_temperature)
        total = block_sum(total, warp_totals, warps)
        if cuda.threadIdx.x == 0:
            slice_max[block] = values[0]
            slice_sum[block] = total

    @cuda.jit
    def candidates_merge(candidate_values, candidate_indices, merged_values, merged_indices):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        values = cuda.shared.array(group_pairs, float32)
        indices = cuda.shared.array(group_pairs, int32)
        first = cuda.blockIdx.x * group_pairs
        for t in range(cuda.threadIdx.x, group_pairs, threads):
            values[t] = candidate_values[first + t]
            indices[t] = candidate_indices[first + t]
        cuda.syncthreads()
        merge_group(values, indices)
        for t in range(cuda.threadIdx.x, candidates, threads):
            merged_values[cuda.blockIdx.x * candidates + t] = values[t]
            merged_indices[cuda.blockIdx.x * candidates + t] = indices[t]

    @cuda.jit
    def candidates_select(merged_values, merged_indices, slice_max, slice_sum, sampling, top_k,
                          seed, tokens, pos):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        top_values = cuda.shared.array(top_pairs, float32)
        top_indices = cuda.shared.array(top_pairs, int32)
        cdf = cuda.shared.array(candidates, float32)
        warp_totals = cuda.shared.array(32, float32)
        kept = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        p = pos[0]

        # 1. The groups' merged lists into shared memory, merged there until list 0 holds the
        #    top `candidates` of the whole vocabulary.
        for t in range(tid, top_pairs, threads):
            top_values[t] = merged_values[t]
            top_indices[t] = merged_indices[t]
        cuda.syncthreads()
        merge_groups(top_values, top_indices)

        # 2. The softmax normaliser over the whole vocabulary, relative to the largest logit.
        inv_temperature = sampling[0]
        top_p = sampling[1]
        best = top_values[0]
        part = float32(0.0)
        for s in range(tid, lists, threads):
            part += slice_sum[s] * math.exp((slice_max[s] - best) * inv_temperature)
        z_vocab = block_sum(part, warp_totals, warps)

        # 3. Unnormalised probabilities of the first k candidates and their running sum, `threads`
        #    at a time: each warp scans its 32 by shuffles (a lane adds the totals of the lane
        #    groups below it, level by level), then adds the totals of the warps and chunks before.
        k = top_k[0]
        k = valid if k == 0 or k > valid else k
        lane = tid % 32
        carry = float32(0.0)
        for base in range(0, candidates, threads):
            t = base + tid
            prefix = math.exp((top_values[t] - best) * inv_temperature) if t < k else float32(0.0)
            total = prefix
            for level in (1, 2, 4, 8, 16):
                other = shfl_xor(total, level)
                if lane & level:
                    prefix += other
                total += other
            if lane == 31:
                warp_totals[tid // 32] = total
            cuda.syncthreads()
            for w in range(tid // 32):
                prefix += warp_totals[w]
            if t < candidates:
                cdf[t] = carry + prefix
            for w in range(warps):
                carry += warp_totals[w]
            cuda.syncthreads()  # every warp has read warp_totals before the next chunk writes it

        # 4. The nucleus: candidate t stays while the mass before it is below top_p of the total
        #    (the whole vocabulary's, or the top k's when top_k is set, as transformers does).
        z = z_vocab if top_k[0] == 0 else cdf[k - 1]
        if tid == 0:
            kept[0] = 0
        cuda.syncthreads()
        for t in range(tid, k, threads):
            if t == 0 or cdf[t - 1] < top_p * z:
                cuda.atomic.add(kept, 0, 1)
        cuda.syncthreads()
        n = kept[0]

        # 5. Inverse-CDF draw among the n kept: the t with cdf[t - 1] <= u * cdf[n - 1] < cdf[t].
        target = uniform(seed[0], p, vocab_size) * cdf[n - 1]
        for t in range(tid, n, threads):
            before = cdf[t - 1] if t > 0 else float32(0.0)
            if before <= target and (target < cdf[t] or t == n - 1):
                tokens[p + 1] = top_indices[t]
                pos[0] = p + 1

    return candidates_partial, candidates_merge, candidates_select, threads
