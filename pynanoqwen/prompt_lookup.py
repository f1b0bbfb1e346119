"""Prompt-lookup speculative decoding: draft tokens from the context, verify them in one pass.

When a coding assistant edits a file, most of what it writes is already in its prompt. So instead of
one token per forward pass:
1. **Draft.** Take the last n tokens of the context (prompt plus generated so far), find where they
   occurred before, and propose the up to K tokens that followed that occurrence. n runs from
   `max_ngram` down to `min_ngram`, so the longest match wins; among matches of one length the
   most recent wins (the nearest copy of the text being rewritten). No match: no draft, and the
   step is an ordinary decode step.
2. **Verify.** Run the last sampled token and the K drafted ones through the model at once: K + 1
   positions, whose logits say what the model itself would have produced after each prefix.
3. **Accept** the longest prefix of the draft the model agrees with, plus the model's own token
   after it (so a step yields at least one token, as decode does, and at most K + 1).
4. **Roll back** the KV cache to the accepted positions: the rejected positions' keys and values
   were written by the verify pass and are simply overwritten later.

Lossless. Greedy: a drafted token is accepted exactly when it is the argmax the model computes
after its prefix, so the output is token for token what plain decoding gives, provided the verify
pass computes each position's logits bit for bit as a decode step does (the CPU reference runs its
rows one at a time for that: reference.ReferenceModel.forward's row_by_row). Sampling: the drafter
is deterministic, a point mass q on the drafted token t, so the speculative-sampling rule
(Leviathan et al. 2023, Chen et al. 2023) becomes: accept t with probability min(1, p(t) / q(t)) =
p(t), where p is the distribution `sampling.sample` draws from (temperature, top-k, top-p applied);
on rejection draw from the residual max(p - q, 0), normalised: p without t. A step that accepts all
K draws its last token from p after the whole draft. Each emitted token then has exactly
distribution p given its prefix, as without lookup; only the random stream differs, so a seed gives
other (equally distributed) text than `--prompt-lookup 0`.

docs/SPECULATIVE.md explains when it pays and what it costs when nothing matches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .errors import NanoQwenError
from .sampling import SamplingParams, candidate_probabilities, draw, sample

MAX_DRAFT_TOKENS = 15  # verify runs K + 1 <= 16 positions: one small-M GEMM tile on the GPU
MAX_NGRAM = 16


@dataclasses.dataclass(frozen=True)
class LookupParams:
    """draft_tokens 0 turns prompt lookup off (plain decoding)."""

    draft_tokens: int = 0
    min_ngram: int = 1
    max_ngram: int = 3

    def validate(self) -> "LookupParams":
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise NanoQwenError(f"--prompt-lookup must be between 0 (off) and {MAX_DRAFT_TOKENS}, "
                                f"got {self.draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise NanoQwenError(f"the lookup n-gram lengths must satisfy 1 <= min <= max <= {MAX_NGRAM}, "
                                f"got min {self.min_ngram}, max {self.max_ngram}")
        return self

    @property
    def enabled(self) -> bool:
        return self.draft_tokens > 0


def check_device(lookup: LookupParams, device: str) -> None:
    """Refuse lookup on a device without a verify pass: only the CPU reference has one so far."""
    if lookup.enabled and device != "cpu":
        raise NanoQwenError("--prompt-lookup runs on the CPU reference only (--device cpu): the GPU engine's "
                            "verify pass is not built yet")


def lookup_params(draft_tokens: int, ngram: str) -> LookupParams:
    """LookupParams from `--prompt-lookup K --lookup-ngram MIN:MAX` (validated)."""
    low, colon, high = ngram.partition(":")
    try:
        min_ngram, max_ngram = int(low), int(high if colon else low)
    except ValueError:
        raise NanoQwenError(f"--lookup-ngram must be MIN:MAX (two whole numbers, e.g. 1:3), got {ngram!r}") from None
    return LookupParams(draft_tokens, min_ngram, max_ngram).validate()


@dataclasses.dataclass
class LookupStats:
    """What prompt lookup did during one generation."""

    verify_passes: int = 0  # forward passes that checked a draft
    plain_steps: int = 0  # forward passes after the prompt without a draft (nothing matched)
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, tokens the model agreed with

    def summary(self) -> str:
        rate = f" ({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else ""
        return (f"prompt lookup: {self.accepted} of {self.drafted} drafted tokens accepted{rate} "
                f"in {self.verify_passes} verify passes and {self.plain_steps} plain steps")


class Drafter:
    """Drafts for one generation: the context so far and, for every n-gram length, where each
    n-gram last occurred with a token after it. Appending a token registers the n-grams it
    completes a continuation for, so drafting costs O(max_ngram) per step, whatever the context's
    length (a scan of a 32k context costs about 3 ms in numpy, more than a whole decode step)."""

    def __init__(self, params: LookupParams, prompt_ids: Sequence[int] = ()):
        self.params = params
        self.context: list[int] = []
        self._last_start: list[dict[tuple[int, ...], int]] = [{} for _ in range(params.max_ngram + 1)]
        self.extend(prompt_ids)

    def extend(self, tokens: Sequence[int]) -> None:
        context, low, high = self.context, self.params.min_ngram, self.params.max_ngram
        for token in tokens:
            end = len(context)  # the n-grams ending just before the new token now have a continuation
            for n in range(low, min(high, end) + 1):
                self._last_start[n][tuple(context[end - n:end])] = end - n
            context.append(int(token))

    def propose(self, limit: int) -> list[int]:
        """Up to min(draft_tokens, limit) tokens that followed an earlier occurrence of the
        context's last n tokens: the longest n in [min_ngram, max_ngram] that occurs, its most
        recent occurrence. [] when none occurs."""
        want, context = min(self.params.draft_tokens, limit), self.context
        if want <= 0:
            return []
        for n in range(min(self.params.max_ngram, len(context)), self.params.min_ngram - 1, -1):
            start = self._last_start[n].get(tuple(context[len(context) - n:]))
            if start is not None:
                return context[start + n:start + n + want]
        return []


def accept_greedy(draft: Sequence[int], logits: np.ndarray) -> list[int]:
    """The tokens a greedy verify step yields: logits [len(draft) + 1, vocab], row i the logits
    after the prefix plus draft[:i]. The accepted draft tokens, then the model's own next one."""
    out = []
    for i, drafted in enumerate(draft):
        best = int(np.argmax(logits[i]))
        out.append(best)
        if best != drafted:
            return out
    out.append(int(np.argmax(logits[len(draft)])))
    return out


def accept_sampled(draft: Sequence[int], logits: np.ndarray, params: SamplingParams,
                   rng: np.random.Generator) -> list[int]:
    """The speculative-sampling rule for a point-mass draft (the module docstring): each emitted
    token is distributed as `sample` would draw it after its prefix."""
    out = []
    for i, drafted in enumerate(draft):
        ids, probs = candidate_probabilities(logits[i], params)
        where = np.flatnonzero(ids == drafted)
        p_drafted = float(probs[where[0]]) if where.size else 0.0
        if rng.random() < p_drafted:
            out.append(int(drafted))
            continue
        residual = probs.copy()
        if where.size:
            residual[where[0]] = 0.0
        residual /= residual.sum()  # p_drafted < 1 here, so something is left
        out.append(draw(ids, residual, rng))
        return out
    out.append(sample(logits[len(draft)], params, rng))
    return out
