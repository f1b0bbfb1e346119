"""Sampling parameters, shared by the CPU reference path and the GPU engine, and the CPU sampler.

`sample` is the numpy definition of how the next token is chosen from a logits vector: greedy
argmax at temperature 0, otherwise temperature, then top-k, then top-p (nucleus), in that order
(the order of transformers' logits warpers), in float64. The GPU engine samples on the device with
its own random numbers, so the two paths agree on the distribution, not on the sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import MAX_INT32
from .errors import NanoQwenError

# Temperatures below this sample as greedy, their limit. Much smaller ones overflow the scaled logits
# into NaN probabilities (1 / T is a float32 on the GPU: inf below 3e-39), and already at this one every
# token but the argmax has probability below e^-100 unless its logit is within 1e-28 of the largest.
MIN_SAMPLING_TEMPERATURE = 1e-30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_SAMPLING_TEMPERATURE) means greedy (argmax); top_k 0 and top_p 1.0
    mean 'no limit'."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature > 100:
            raise NanoQwenError(f"--temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise NanoQwenError(f"--top-k must be >= 0, got {self.top_k}")
        if self.top_k > MAX_INT32:  # the GPU sampler holds it in an int32
            raise NanoQwenError(f"--top-k must be at most {MAX_INT32}, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise NanoQwenError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**63):
            raise NanoQwenError(f"--seed must be in [0, 2^63), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def candidate_probabilities(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that may be sampled and their probabilities (float64, summing to 1), most
    probable first. Only meaningful for temperature > 0."""
    scaled = logits.astype(np.float64) / params.temperature
    # A stable sort of the negated logits: most probable first, equal logits in id order.
    order = np.argsort(-scaled, kind="stable")
    if params.top_k:
        order = order[:params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        # The nucleus: the fewest most-probable tokens whose probability reaches top_p.
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep]
        probs /= probs.sum()
    return order, probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token id for one logits vector [vocab].

    Greedy picks the lowest id among equal maxima and draws nothing from `rng`; otherwise exactly
    one uniform number is drawn, so a generation seeded with `np.random.default_rng(seed)` once
    is reproducible token by token."""
    if params.greedy:
        return int(np.argmax(logits))
    return draw(*candidate_probabilities(logits, params), rng)


def draw(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One of `ids` with probabilities `probs` (summing to 1), from one uniform number of `rng`."""
    cdf = np.cumsum(probs)
    # Inverse-CDF draw; min() guards against cdf[-1] rounding to just below 1.
    index = min(int(np.searchsorted(cdf, rng.random(), side="right")), len(ids) - 1)
    return int(ids[index])
