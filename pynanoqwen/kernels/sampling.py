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
  (a power of two; 256 slices of 594 logits at vocab 152064), one block of 512 threads each,
  which sorts its slice (bitonic sort of 1024 (logit, id) pairs, best first: two a thread in
  registers, the stages of strides below 64 by warp shuffles, the other 10 of 55 through shared
  memory) and keeps its top CANDIDATES = 256, plus the slice's max and sum of exp((logit - max) / T).
  `candidates_merge` (LISTS / 16 blocks) loads 16 lists into shared memory and merges them pairwise
  (keep the better of A[i] and B[255 - i], which is a bitonic sequence holding the top 256 of
  both, then a bitonic merge, its half strides below 64 by shuffles as in the sort) in log2(16)
  rounds, to the top 256 of its 16 slices in order;
  `candidates_select`, one block, merges those 16 lists the same way, to the exact top 256 of the
  vocabulary. Then, as transformers does and as pynanoqwen.sampling.sample defines it: softmax at
  temperature T, keep the top k, keep the fewest whose probability reaches top_p, draw one by
  inverse CDF. kernels/sampling_candidates.py builds these three; kernels/sampling_device.py
  holds the device functions both methods share.

Approximation, "candidates" only: sampling sees the 256 largest logits. top_k above 256 acts as
256. top_p is exact while the nucleus fits in 256 tokens (the full-vocabulary softmax normaliser
is computed from the slices' sums, so the cut-off is right); a wider nucleus is cut at 256
tokens. Greedy and plain temperature sampling are exact.

Random numbers are counter-based: U(seed, pos, i) hashes the seed, the position and an index
(the vocabulary id for Gumbel noise, `vocab` for the inverse-CDF draw) with splitmix64's
finaliser. No generator state advances, so a given seed and prompt give the same tokens in
graph and eager mode, and the GPU and CPU samplers agree on the distribution, not the sequence.

Traffic: the logits, 0.6 MB at vocab 152064, read once by each method (the candidate lists,
512 KiB, stay in L2, and are read once more by candidates_merge). Both methods are latency-bound,
not traffic-bound: argmax should take a few us (one block finishes it), candidates a chain of
sorting and merging stages; bench's kernel table times the argmax, docs/PERFORMANCE.md has the
figures of both.

Device parameters: `sampling` float32 [2] = (1 / temperature, 0 for greedy; top_p),
`top_k` int32 [1] (0: no limit), `seed` uint64 [1].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..sampling import SamplingParams
from . import CompileTarget
from .sampling_candidates import candidate_kernels, merge_groups_of
from .sampling_device import NO_ID, better, block_argmax, uniform

ARGMAX_THREADS = 256
ARGMAX_ITEMS = 8           # logits per argmax thread: vocab 152064 -> 75 blocks
CANDIDATES = 256           # logits that top-k / top-p sampling sees, a power of two
# (logit, id) pairs one block sorts (8 KiB of shared memory). 1024 against 2048 on an H100: 54.3
# against 59.6 us a sampled token, the same tokens (docs/PERFORMANCE.md, "2026-12-06, evening").
SORT_SIZE = 1024
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
            candidate_kernels(vocab_size, candidates, sort_size, self.lists)
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


def compile_targets() -> list[CompileTarget]:
    """Every sampling kernel at the 7B vocabulary with the GPU's block shapes, and at a tiny one."""
    f32, i32, u64 = types.float32[::1], types.int32[::1], types.uint64[::1]
    targets = [CompileTarget("advance_prompt", advance_prompt, types.void(i32))]
    for vocab in (152064, 2048):
        blocks = -(-vocab // (ARGMAX_THREADS * ARGMAX_ITEMS))
        lists = 1 << max(0, math.ceil(math.log2(-(-vocab // SORT_SIZE))))
        partial, finish = _argmax_kernels(vocab, ARGMAX_THREADS, blocks)
        select_partial, merge, select, _ = candidate_kernels(vocab, CANDIDATES, SORT_SIZE, lists)
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
