"""What a loaded model is to the commands: the `Backend` interface, the CPU backend, and loading.

A backend owns a loaded model and turns prompt ids into new token ids. There are two:
`CpuBackend` here, over the numpy reference model (reference.py) and the numpy sampler
(sampling.py), and `engine.CudaBackend`, which runs the INT4 kernels and samples on the GPU.
`GpuEngine` declares what the GPU engine offers beyond generating, the hooks that validate's GPU
tiers, generate's self-check (selfcheck.py) and bench call; stand-ins in the tests implement the
same methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from . import device
from .config import ModelConfig
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .reference import ReferenceModel
from .prompt_lookup import Drafter, LookupParams, LookupStats, accept_greedy, accept_sampled
from .sampling import SamplingParams, sample

Probe = dict  # {(layer or None, stage): {buffer name: host array}}: what each launch of a probe wrote


class Backend(Protocol):
    """What `generate` needs from a loaded model, on any device.

    `generate` resets the backend's KV cache, runs the prompt, then yields one sampled token id
    at a time, as soon as it is known. It yields at most `max_new_tokens` ids and stops right
    after yielding an id in `stop_ids` (that id is yielded, so the caller can tell why it stopped).
    The caller guarantees len(prompt_ids) + max_new_tokens <= max_context and params.validate().
    Sampling is seeded once per call from params.seed: the same call gives the same tokens.
    `lookup` turns on prompt-lookup speculative decoding (prompt_lookup.py); a backend that has no
    verify pass for it raises NanoQwenError when it is enabled. `lookup_stats` then holds what it
    did in the latest generation (None without lookup).
    """

    name: str  # starts the summary line, e.g. "cpu (numpy reference)"
    max_context: int  # positions the KV cache holds: prompt plus generated tokens

    def prepare(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Do, before the clock starts, what a prompt of this many tokens would otherwise do inside
        the time to first token (the GPU engine compiles and captures its prefill graphs)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: frozenset[int], lookup: LookupParams = LookupParams()) -> Iterator[int]: ...

    def close(self) -> None:
        """Give back what the backend holds beyond garbage-collected memory (CUDA graphs)."""


class GpuEngine(Backend, Protocol):
    """engine.CudaBackend as validate, the self-check and bench use it (engine/probes.py)."""

    config: ModelConfig
    gemv: str  # the INT4 GEMV path, kernels.GEMV_PATHS
    eager: bool  # launch kernels one by one instead of replaying graphs (settable)
    stream: object
    weight_bytes_per_step: int

    def reset(self, prompt_ids, params: SamplingParams) -> None: ...

    def teacher_forced_logits(self, token_ids) -> np.ndarray:
        """float32 [len, vocab]: row p the logits after token_ids[0..p], one decode step each."""

    def prefill_logits(self, token_ids) -> np.ndarray:
        """The same rows, through one batched prefill of token_ids."""

    def layer_outputs(self, layer: int, hidden_states: np.ndarray) -> np.ndarray:
        """One decoder layer alone on hidden states [seq, hidden] at positions 0.."""

    def probed_step(self, first_token: int, token: int) -> Probe:
        """What every launch of the decode step at position 1 wrote (after first_token at 0)."""

    def probed_prefill(self, token_ids, rows: int | None = None) -> Probe:
        """What every launch of one prefill chunk of token_ids wrote (in the bucket of `rows` rows)."""

    def probe_buckets(self, probe_tokens: int, prompt_tokens: int | None = None) -> list[int]:
        """The buckets whose GEMM kernels a self-check's chunk must run in to launch them all."""

    rows_sum_alike: bool  # a prompt row's results have the same bits in every bucket

    def kernel_groups(self, context: int, method: str) -> list[tuple[str, Callable[[], None], int, int]]:
        """A decode step's launches by stage: (name, enqueue, launches, bytes) each."""

    def prefill_kernel_groups(self, rows: int, method: str) -> list[tuple[str, Callable[[], None], int, int]]:
        """A prefill chunk's launches by stage, as kernel_groups."""

    def prefill_chunk_launches(self, rows: int, method: str, token_ids=None) -> list:
        """A prefill chunk's launches in order (engine.schedule.Launch each)."""

    def bytes_per_step(self, context: int) -> int: ...

    def device_memory_used(self) -> int: ...


class CpuBackend:
    """The numpy reference model with the numpy sampler: slow, the oracle the GPU engine is
    tested against, and runs anywhere."""

    name = "cpu (numpy reference)"

    def __init__(self, model):
        self.model = model  # a reference.ReferenceModel, or anything with its forward/reset/rewind
        self.max_context = model.max_context
        self.lookup_stats: LookupStats | None = None

    def prepare(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Nothing to do ahead: numpy compiles nothing."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: frozenset[int], lookup: LookupParams = LookupParams()) -> Iterator[int]:
        self.model.reset()
        logits = self.model.forward(prompt_ids, last_only=True)[-1]
        yield from self.decode(logits, params, max_new_tokens, stop_ids, prompt_ids, lookup)

    def decode(self, logits: np.ndarray, params: SamplingParams, max_new_tokens: int,
               stop_ids: frozenset[int], prompt_ids: list[int], lookup: LookupParams) -> Iterator[int]:
        """The generation after the prompt ran: sample from the prompt's last `logits`, then run
        each sampled token through the model for the next, as `generate` describes; with lookup,
        each pass runs the sampled token and a draft from the context (prompt_lookup.py)."""
        self.lookup_stats = LookupStats() if lookup.enabled else None
        if max_new_tokens < 1:  # /infill's n_predict 0: the prompt only (a cache warm-up), as the GPU engine does
            return
        rng = np.random.default_rng(params.seed)
        drafter = Drafter(lookup, prompt_ids) if lookup.enabled else None
        new = [sample(logits, params, rng)]
        produced = 0
        while True:
            for token in new:
                yield token
                produced += 1
                if token in stop_ids or produced == max_new_tokens:
                    return
            draft = []
            if drafter is not None:
                drafter.extend(new)
                # A draft short enough that it, the last sampled token and the model's own next
                # token fit the budget and the cache.
                draft = drafter.propose(min(max_new_tokens - produced - 1, self.max_context - self.model.position - 1))
                if not draft:
                    self.lookup_stats.plain_steps += 1
            if not draft:
                new = [sample(self.model.forward([new[-1]])[-1], params, rng)]
                continue
            start = self.model.position
            rows = self.model.forward([new[-1]] + draft, row_by_row=True)
            new = accept_greedy(draft, rows) if params.greedy else accept_sampled(draft, rows, params, rng)
            self.model.rewind(start + len(new))  # the last token and the accepted draft are cached
            self.lookup_stats.verify_passes += 1
            self.lookup_stats.drafted += len(draft)
            self.lookup_stats.accepted += len(new) - 1

    def close(self) -> None:
        """The model reads its file's mmap, which the garbage collector closes."""


def load_backend(model_path, device_name: str, max_context: int, gemv: str = "auto",
                 eager: bool = False) -> Backend:
    """Load the model in `model_path` for `device_name` ("cpu" or "cuda") with room for
    `max_context` positions. `gemv` (INT4 GEMV path) and `eager` (no CUDA graph) only matter
    on the GPU."""
    if device_name == "cpu":
        # The model reads its weights from the file's mmap as it runs, so the file stays open.
        return CpuBackend(ReferenceModel(NanoQwenFile(model_path), max_context=max_context))
    if device_name == "cuda":
        return load_engine(model_path, max_context, gemv, eager)
    raise NanoQwenError(f"--device must be cuda or cpu, got {device_name!r}")


def load_engine(model_path, max_context: int, gemv: str = "auto", eager: bool = False) -> GpuEngine:
    """The GPU engine (engine.CudaBackend) on `model_path`; one NanoQwenError line when there is
    no GPU, or when the engine's CUDA libraries cannot be imported."""
    if not device.cuda_gpu_available():
        raise NanoQwenError("no CUDA GPU found; use --device cpu")
    try:
        from .engine import CudaBackend  # numba-cuda's CUDA libraries load only when a GPU is used
    except ImportError as err:
        raise NanoQwenError(f"the GPU engine cannot be loaded ({err}); use --device cpu") from None
    return CudaBackend(model_path, max_context=max_context, gemv=gemv, eager=eager)
