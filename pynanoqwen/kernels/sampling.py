"""Choosing the next token on the GPU: greedy argmax, temperature, top-k and top-p sampling.

The last kernels of a decode step. They read the logits float32 [vocab] and the per-step state,
write the chosen id into `tokens[pos + 1]` and advance `pos` (docs/DECODE.md), all in device
memory, so a step needs no host round trip and one captured CUDA graph serves every step. The
sampling parameters live in device memory too (`device_params`), so one graph serves any values.

Methods (`method_for` picks one per generation; each is the tail of its own graph):

- "prompt": inside the prompt the next token is already known (it is in `tokens`), so the step
  skips the lm_head and this kernel only advances `pos`.
- "argmax": `argmax_partial` (ceil(vocab / 2048) blocks of 256 threads; each thread scans 8
  logits, the block folds them with warp shuffles into its best (value, id)) then
  `argmax_finish` (one block folds the blocks' winners). Temperature 0 is exact greedy decoding:
  the largest logit, the lowest id among equal ones (numpy's argmax). Temperature T > 0 without
  top-k / top-p uses the same reduction on logit / T + G with G = -log(-log(U)), U uniform: the
  Gumbel-max trick, an exact sample of softmax(logits / T) over the whole vocabulary.
- "candidates" (top-k and/or top-p): `candidates_partial` splits the vocabulary into LISTS slices
  (a power of two; 128 slices of 1188 logits at vocab 152064), one block of 1024 threads each,
  which sorts its slice in shared memory (bitonic sort of 2048 (logit, id) pairs, best first)
  and keeps its top CANDIDATES = 256, plus the slice's max and sum of exp((logit - max) / T).
  `candidates_merge` (LISTS / 16 blocks) loads 16 lists into shared memory and merges them pairwise
  (keep the better of A[i] and B[255 - i], which is a bitonic sequence holding the top 256 of
  both, then a bitonic merge) in log2(16) rounds, to the top 256 of its 16 slices in order;
  `candidates_select`, one block, merges those 8 lists the same way, to the exact top 256 of the
  vocabulary. Then, as transformers does and as pynanoqwen.sampling.sample defines it: softmax at
  temperature T, keep the top k, keep the fewest whose probability reaches top_p, draw one by
  inverse CDF. (Before 2026-12-06 one block merged all 128 lists in global memory:
  docs/PERFORMANCE.md has both timings.)

Approximation, "candidates" only: sampling sees the 256 largest logits. top_k above 256 acts as
256. top_p is exact while the nucleus fits in 256 tokens (the full-vocabulary softmax normaliser
is computed from the slices' sums, so the cut-off is right); a wider nucleus is cut at 256
tokens. Greedy and plain temperature sampling are exact.

Random numbers are counter-based: U(seed, pos, i) hashes the seed, the position and an index
(the vocabulary id for Gumbel noise, `vocab` for the inverse-CDF draw) with splitmix64's
finaliser. No generator state advances, so a given seed and prompt give the same tokens in
graph and eager mode, and the GPU and CPU samplers agree on the distribution, not the sequence.

Traffic: the logits, 0.6 MB at vocab 152064, read once by each method (the candidate lists,
256 KiB, stay in L2, and are read once more by candidates_merge). Argmax should take a few us (one block finishes it: latency-bound); bench's
kernel table measures it, docs/PERFORMANCE.md has the figures.

Device parameters: `sampling` float32 [2] = (1 / temperature, 0 for greedy; top_p),
`top_k` int32 [1] (0: no limit), `seed` uint64 [1].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint64
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.warp import shfl_xor, warp_sum
from ..sampling import SamplingParams
from . import CompileTarget

ARGMAX_THREADS = 256
ARGMAX_ITEMS = 8           # logits per argmax thread: vocab 152064 -> 75 blocks
CANDIDATES = 256           # logits that top-k / top-p sampling sees, a power of two
SORT_SIZE = 2048           # (logit, id) pairs one block sorts: 16 KiB of shared memory
MERGE_GROUP = 16           # sorted lists one candidates_merge block merges: 32 KiB of shared memory
NO_ID = 2**31 - 1          # an id worse than any real one, for "nothing seen yet"
METHODS = ("prompt", "argmax", "candidates")


def method_for(params: SamplingParams) -> str:
    """The sampling kernels that realise `params` when the next token is not the prompt's."""
    if params.greedy or (params.top_k == 0 and params.top_p >= 1.0):
        return "argmax"
    return "candidates"


def device_params(params: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host arrays to copy into the `sampling`, `top_k` and `seed` device buffers."""
    inv_temperature = 0.0 if params.greedy else 1.0 / params.temperature
    return (np.array([inv_temperature, params.top_p], dtype=np.float32),
            np.array([params.top_k], dtype=np.int32),
            np.array([params.seed], dtype=np.uint64))


def uniform_reference(seed: int, position: int, index) -> np.ndarray:
    """numpy model of the device's `uniform(seed, position, index)`, exactly (float64 holds it)."""
    def mix(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):  # multiplication modulo 2^64 is the point
        counter = (np.uint64(position) << np.uint64(32)) | np.asarray(index, dtype=np.uint64)
        z = mix(np.uint64(seed) ^ mix(counter))
    return ((z >> np.uint64(41)).astype(np.float64) + 0.5) / 2.0**23


# ---------------------------------------------------------------------------------------------
# Device functions shared by the kernels

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


# ---------------------------------------------------------------------------------------------
# Kernels, specialised on the vocabulary size and the launch shape

@cuda.jit
def advance_prompt(pos):
    launch_dependents()
    grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
    pos[0] += 1


@functools.cache
def _argmax_kernels(vocab_size: int, threads: int, blocks: int):
    warps = threads // 32
    chunk = -(-vocab_size // blocks)

    @cuda.jit
    def argmax_partial(logits, sampling, seed, pos, partial_values, partial_indices):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        warp_values = cuda.shared.array(32, float32)
        warp_indices = cuda.shared.array(32, int32)
        start = cuda.blockIdx.x * chunk
        end = min(start + chunk, vocab_size)
        inv_temperature = sampling[0]
        s = seed[0]
        p = pos[0]
        best_value, best_index = float32(-math.inf), int32(NO_ID)
        # Each thread visits its ids in increasing order, so `>` keeps the lowest of equal ones.
        for i in range(start + cuda.threadIdx.x, end, threads):
            value = logits[i]
            if inv_temperature > 0:
                value = value * inv_temperature - math.log(-math.log(uniform(s, p, i)))
            if value > best_value:
                best_value, best_index = value, int32(i)
        best_value, best_index = block_argmax(best_value, best_index, warp_values, warp_indices, warps)
        if cuda.threadIdx.x == 0:
            partial_values[cuda.blockIdx.x] = best_value
            partial_indices[cuda.blockIdx.x] = best_index

    @cuda.jit
    def argmax_finish(partial_values, partial_indices, tokens, pos):
        launch_dependents()
        grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
        warp_values = cuda.shared.array(32, float32)
        warp_indices = cuda.shared.array(32, int32)
        best_value, best_index = float32(-math.inf), int32(NO_ID)
        for b in range(cuda.threadIdx.x, blocks, threads):
            if better(best_value, best_index, partial_values[b], partial_indices[b]):
                best_value, best_index = partial_values[b], partial_indices[b]
        best_value, best_index = block_argmax(best_value, best_index, warp_values, warp_indices, warps)
        if cuda.threadIdx.x == 0:
            p = pos[0]
            tokens[p + 1] = best_index
            pos[0] = p + 1

    return argmax_partial, argmax_finish


def merge_groups_of(lists: int) -> tuple[int, int]:
    """(lists a candidates_merge block merges, blocks of candidates_merge): the second is how many
    lists candidates_select merges, at most MERGE_GROUP too (its shared memory)."""
    group = min(MERGE_GROUP, lists)
    if lists // group > MERGE_GROUP:
        raise ValueError(f"{lists} candidate lists are more than {MERGE_GROUP}^2 (a larger sort_size would do)")
    return group, lists // group


@functools.cache
def _candidate_kernels(vocab_size: int, candidates: int, sort_size: int, lists: int):
    threads = sort_size // 2  # one compare-exchange per thread per sorting stage
    warps = threads // 32
    chunk = -(-vocab_size // lists)
    valid = min(candidates, vocab_size)  # candidates that are real logits, not padding
    candidate_shift = candidates.bit_length() - 1  # candidates = 1 << candidate_shift
    group, groups = merge_groups_of(lists)
    group_pairs, top_pairs = group * candidates, groups * candidates  # shared-array sizes: constants

    @cuda.jit(device=True, inline="always")
    def bitonic_sort(values, indices):
        """Sort sort_size (value, index) pairs in shared memory, best first (Batcher's network).
        Strides are powers of two held as shifts: `t // stride` by a stride known only at run
        time is a 64-bit division, tens of instructions beside a compare-exchange's few."""
        size_shift = 1
        while (1 << size_shift) <= sort_size:
            stride_shift = size_shift - 1
            while stride_shift >= 0:
                for t in range(cuda.threadIdx.x, sort_size // 2, threads):
                    i = ((t >> stride_shift) << (stride_shift + 1)) | (t & ((1 << stride_shift) - 1))
                    order_pair(values, indices, i, i + (1 << stride_shift), (i >> size_shift) & 1 == 0)
                cuda.syncthreads()
                stride_shift -= 1
            size_shift += 1

    def merge_network(count: int):
        """A device function that merges `count` (a power of two) sorted lists of `candidates`
        (value, index) pairs, held one after another in `values`/`indices` (shared memory), until
        list 0 holds the top `candidates` of all, in order. Round `width`: list a = 2 * width *
        pair absorbs list a + width: max(A[e], B[last - e]) holds the top of A and B as a bitonic
        sequence, which log2(candidates) half-cleaner stages put in order. Widths and halves are
        powers of two held as shifts (no run-time division)."""

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
                while half_shift >= 0:
                    for t in range(tid, pairs * (candidates // 2), threads):
                        e = t % (candidates // 2)
                        i = ((t // (candidates // 2)) * 2 * width * candidates + ((e >> half_shift) << (half_shift + 1))
                             + (e & ((1 << half_shift) - 1)))
                        order_pair(values, indices, i, i + (1 << half_shift), True)
                    cuda.syncthreads()
                    half_shift -= 1
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
        scan = cuda.shared.array(candidates, float32)
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

        # 3. Unnormalised probabilities of the first k candidates and their running sum
        #    (Hillis-Steele scan: log2(candidates) rounds of "add the value `offset` places back").
        k = top_k[0]
        k = valid if k == 0 or k > valid else k
        for t in range(tid, candidates, threads):
            cdf[t] = math.exp((top_values[t] - best) * inv_temperature) if t < k else float32(0.0)
        cuda.syncthreads()
        offset = 1
        while offset < candidates:
            for t in range(tid, candidates, threads):
                scan[t] = cdf[t] + cdf[t - offset] if t >= offset else cdf[t]
            cuda.syncthreads()
            for t in range(tid, candidates, threads):
                cdf[t] = scan[t]
            cuda.syncthreads()
            offset *= 2

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


class Sampler:
    """The sampling kernels for one vocabulary size, with their scratch buffers.

    The scratch (per-block winners, candidate lists) is allocated here, once, when the engine
    builds the sampler; `launch` allocates nothing. The keyword arguments exist so that the CUDA
    simulator can run the same kernels with small blocks; the defaults are the GPU's.
    """

    def __init__(self, vocab_size: int, *, candidates: int = CANDIDATES, sort_size: int = SORT_SIZE,
                 argmax_threads: int = ARGMAX_THREADS):
        for name, value in (("candidates", candidates), ("sort_size", sort_size)):
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        # MERGE_GROUP lists of candidates (value, id) pairs must fit 48 KiB of static shared memory.
        if not (candidates <= min(sort_size, CANDIDATES) and 64 <= sort_size <= 2048 and argmax_threads % 32 == 0
                and 32 <= argmax_threads <= 1024):
            raise ValueError(f"unsupported sampler shape: candidates {candidates}, sort_size {sort_size}, "
                             f"argmax_threads {argmax_threads}")
        self.vocab_size = vocab_size
        self.candidates = candidates
        self.argmax_threads = argmax_threads
        self.argmax_blocks = -(-vocab_size // (argmax_threads * ARGMAX_ITEMS))
        self.lists = 1 << max(0, math.ceil(math.log2(-(-vocab_size // sort_size))))
        self.argmax_partial, self.argmax_finish = _argmax_kernels(vocab_size, argmax_threads, self.argmax_blocks)
        self.merge_blocks = merge_groups_of(self.lists)[1]
        self.candidates_partial, self.candidates_merge, self.candidates_select, self.candidate_threads = \
            _candidate_kernels(vocab_size, candidates, sort_size, self.lists)
        self.partial_values = cuda.device_array(self.argmax_blocks, np.float32)
        self.partial_indices = cuda.device_array(self.argmax_blocks, np.int32)
        self.candidate_values = cuda.device_array(self.lists * candidates, np.float32)
        self.candidate_indices = cuda.device_array(self.lists * candidates, np.int32)
        self.merged_values = cuda.device_array(self.merge_blocks * candidates, np.float32)
        self.merged_indices = cuda.device_array(self.merge_blocks * candidates, np.int32)
        self.slice_max = cuda.device_array(self.lists, np.float32)
        self.slice_sum = cuda.device_array(self.lists, np.float32)

    @staticmethod
    def scratch_nbytes(vocab_size: int) -> int:
        """Device bytes a default-shaped Sampler allocates (for the engine's memory check)."""
        lists = 1 << max(0, math.ceil(math.log2(-(-vocab_size // SORT_SIZE))))
        return 8 * (-(-vocab_size // (ARGMAX_THREADS * ARGMAX_ITEMS)) + (lists + merge_groups_of(lists)[1]) * CANDIDATES
                    + lists)

    def launch(self, stream, method: str, logits, sampling, top_k, seed, tokens, pos) -> None:
        """Choose tokens[pos + 1] and advance pos, by `method` (one of METHODS).

        logits float32 [vocab]; sampling float32 [2], top_k int32 [1], seed uint64 [1] as in
        `device_params`; tokens int32 [>= pos + 2]; pos int32 [1].
        """
        if method == "prompt":
            launch(advance_prompt, 1, 1, stream, (pos,))
        elif method == "argmax":
            launch(self.argmax_partial, self.argmax_blocks, self.argmax_threads, stream,
                   (logits, sampling, seed, pos, self.partial_values, self.partial_indices))
            launch(self.argmax_finish, 1, self.argmax_threads, stream,
                   (self.partial_values, self.partial_indices, tokens, pos))
        elif method == "candidates":
            launch(self.candidates_partial, self.lists, self.candidate_threads, stream,
                   (logits, sampling, self.candidate_values, self.candidate_indices, self.slice_max, self.slice_sum))
            launch(self.candidates_merge, self.merge_blocks, self.candidate_threads, stream,
                   (self.candidate_values, self.candidate_indices, self.merged_values, self.merged_indices))
            launch(self.candidates_select, 1, self.candidate_threads, stream,
                   (self.merged_values, self.merged_indices, self.slice_max, self.slice_sum, sampling, top_k,
                    seed, tokens, pos))
        else:
            raise ValueError(f"unknown sampling method {method!r}; expected one of {METHODS}")


def make_sampler(vocab_size: int, **shape) -> Sampler:
    return Sampler(vocab_size, **shape)


def compile_targets() -> list[CompileTarget]:
    """Every sampling kernel at the 7B vocabulary with the GPU's block shapes, and at a tiny one."""
    f32, i32, u64 = types.float32[::1], types.int32[::1], types.uint64[::1]
    targets = [CompileTarget("advance_prompt", advance_prompt, types.void(i32))]
    for vocab in (152064, 2048):
        blocks = -(-vocab // (ARGMAX_THREADS * ARGMAX_ITEMS))
        lists = 1 << max(0, math.ceil(math.log2(-(-vocab // SORT_SIZE))))
        partial, finish = _argmax_kernels(vocab, ARGMAX_THREADS, blocks)
        select_partial, merge, select, _ = _candidate_kernels(vocab, CANDIDATES, SORT_SIZE, lists)
        targets += [
            CompileTarget(f"argmax_partial[vocab={vocab}]", partial, types.void(f32, f32, u64, i32, f32, i32),
                          ("shfl.sync.bfly.b32",)),
            CompileTarget(f"argmax_finish[vocab={vocab}]", finish, types.void(f32, i32, i32, i32),
                          ("shfl.sync.bfly.b32",)),
            CompileTarget(f"candidates_partial[vocab={vocab}]", select_partial,
                          types.void(f32, f32, f32, i32, f32, f32), ("shfl.sync.bfly.b32",)),
            CompileTarget(f"candidates_merge[vocab={vocab}]", merge, types.void(f32, i32, f32, i32)),
            CompileTarget(f"candidates_select[vocab={vocab}]", select,
                          types.void(f32, i32, f32, f32, f32, i32, u64, i32, i32), ("shfl.sync.bfly.b32",)),
        ]
    return targets
