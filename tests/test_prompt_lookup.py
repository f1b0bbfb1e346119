"""Prompt-lookup speculative decoding (prompt_lookup.py) on the CPU reference: drafting, the verify
pass's bit-exact rows, greedy output identical to plain decoding on the embedded model's editing
workload, and the sampled output's distribution unchanged (a chi-square test against the exact
distribution, with a check that the test catches a wrong acceptance rule)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pynanoqwen import backends
from pynanoqwen.backends import CpuBackend
from pynanoqwen.data import EMBEDDED_MODEL, editing_prompts
from pynanoqwen.errors import NanoQwenError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.prompt_lookup import Drafter, LookupParams, accept_greedy, lookup_params
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.tokenizer import Tokenizer


# --- Drafting ------------------------------------------------------------------------------------

def test_the_longest_ngram_wins_then_the_most_recent_occurrence():
    lookup = LookupParams(draft_tokens=3, min_ngram=1, max_ngram=3)
    # "7 8 9" occurs once, followed by 1 2 3; the 1-gram "9" also occurs later, followed by 5.
    context = [7, 8, 9, 1, 2, 3, 9, 5, 7, 8, 9]
    assert Drafter(lookup, context).propose(10) == [1, 2, 3]
    # Only 1-grams match: the most recent earlier 4 is followed by 6.
    assert Drafter(lookup, [4, 5, 4, 6, 0, 4]).propose(10) == [6, 0, 4]
    assert Drafter(lookup, [4, 5, 4, 6, 0, 4]).propose(2) == [6, 0]
    assert Drafter(LookupParams(3, min_ngram=2, max_ngram=3), [4, 5, 4, 6, 0, 4]).propose(10) == []


def test_no_draft_without_a_match_or_room():
    lookup = LookupParams(draft_tokens=4)
    assert Drafter(lookup, [1, 2, 3, 4]).propose(10) == []
    assert Drafter(lookup, [1]).propose(10) == []
    assert Drafter(lookup, [1, 2, 1, 2, 1]).propose(0) == []
    # The continuation is cut at the end of the context: the match ending just before the suffix.
    assert Drafter(lookup, [1, 2, 1, 2]).propose(10) == [1, 2]


def test_drafts_after_appending_are_those_of_the_whole_context():
    """The index the drafter keeps as tokens arrive gives the drafts a scan of the whole context
    gives (written here as the scan: every earlier window, the longest n, the latest start)."""
    rng = np.random.default_rng()
    lookup = LookupParams(draft_tokens=5, min_ngram=1, max_ngram=3)
    tokens = rng.integers(0, 6, size=300).tolist()  # a small alphabet: many matches of every length
    drafter = Drafter(lookup, tokens[:20])
    for end in range(20, 300):
        context = tokens[:end]
        expected = []
        for n in range(min(3, end - 1), 0, -1):
            starts = [s for s in range(end - n) if context[s:s + n] == context[end - n:]]
            if starts:
                expected = context[starts[-1] + n:starts[-1] + n + 5]
                break
        assert drafter.propose(10) == expected
        drafter.extend([tokens[end]])


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_models_token():
    vocab = 6
    rows = np.zeros((4, vocab), np.float32)
    for row, best in enumerate([3, 1, 4, 2]):
        rows[row, best] = 1.0
    assert accept_greedy([3, 1, 5], rows) == [3, 1, 4]  # the third drafted token is not the argmax
    assert accept_greedy([3, 1, 4], rows) == [3, 1, 4, 2]  # all accepted, plus the bonus token
    assert accept_greedy([0, 1, 4], rows) == [3]


@pytest.mark.parametrize("k, ngram, message", [
    (16, "1:3", r"between 0 \(off\) and 15"), (-1, "1:3", r"between 0 \(off\) and 15"),
    (4, "3:1", "1 <= min <= max"), (4, "0:2", "1 <= min <= max"), (4, "a:b", "MIN:MAX"),
])
def test_bad_lookup_options_are_one_clear_error(k, ngram, message):
    with pytest.raises(NanoQwenError, match=message):
        lookup_params(k, ngram)


# --- The embedded model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded():
    f = NanoQwenFile(EMBEDDED_MODEL)
    tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, None, vocab_size=f.config.vocab_size,
                                          bos_token_id=f.config.bos_token_id,
                                          eos_token_id=f.config.eos_token_id, extra_eos_ids=f.extra_eos_ids)
    return f, tokenizer


def test_verify_rows_are_bit_for_bit_decode_steps(embedded):
    f, _ = embedded
    rng = np.random.default_rng()
    tokens = rng.integers(0, f.config.vocab_size, size=12).tolist()
    stepped = ReferenceModel(f, max_context=64)
    stepped.forward(tokens[:7])
    expected = np.concatenate([stepped.forward([t]) for t in tokens[7:]])
    verified = ReferenceModel(f, max_context=64)
    verified.forward(tokens[:7])
    assert np.array_equal(verified.forward(tokens[7:], row_by_row=True), expected)
    # Rewinding past a rejected draft and running other tokens gives what a cold run gives.
    verified.rewind(9)
    cold = ReferenceModel(f, max_context=64)
    cold.forward(tokens[:7])
    expected = np.concatenate([cold.forward([t]) for t in tokens[7:9] + [5, 6]])[2:]
    assert np.array_equal(verified.forward([5, 6], row_by_row=True), expected)


def test_greedy_lookup_is_token_for_token_plain_decoding_on_100_editing_prompts(embedded):
    """The issue's lossless gate: 100 prompts of the editing workload, 32 tokens each, greedy, with
    K = 8 drafted tokens against --prompt-lookup 0. The drafts must be both accepted and rejected
    (or the test would not exercise the rollback)."""
    f, tokenizer = embedded
    backend = CpuBackend(ReferenceModel(f, max_context=f.config.max_position_embeddings))
    prompts = editing_prompts(tokenizer.encode, 100, source_tokens=120, repeat_tokens=8)
    drafted = accepted = 0
    for prompt in prompts:
        plain = list(backend.generate(prompt, SamplingParams(), 32, tokenizer.stop_ids))
        assert backend.lookup_stats is None
        looked_up = list(backend.generate(prompt, SamplingParams(), 32, tokenizer.stop_ids, LookupParams(8)))
        assert looked_up == plain
        drafted, accepted = drafted + backend.lookup_stats.drafted, accepted + backend.lookup_stats.accepted
    assert 0 < accepted < drafted


# --- Sampling: the distribution is unchanged ------------------------------------------------------------

VOCAB = 5


class BigramModel:
    """A stand-in for ReferenceModel whose logits depend on the last token only: table[last]."""

    def __init__(self, table: np.ndarray, max_context: int = 64):
        self.table, self.max_context = table.astype(np.float32), max_context
        self.reset()

    def reset(self):
        self.tokens, self.position = [], 0

    def forward(self, tokens, *, last_only=False, row_by_row=False):
        self.tokens = self.tokens[:self.position] + list(tokens)
        self.position = len(self.tokens)
        rows = self.table[np.asarray(tokens)]
        return rows[-1:] if last_only else rows

    def rewind(self, position):
        self.position = position


def _exact_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampler's distribution, written independently: float64 softmax of logits / T over the
    top_k largest (top_p 1 in these tests)."""
    scaled = logits.astype(np.float64) / params.temperature
    keep = np.argsort(-scaled)[:params.top_k or len(scaled)]
    p = np.zeros(len(scaled))
    p[keep] = np.exp(scaled[keep] - scaled[keep].max())
    return p / p.sum()


def _chi_square_limit(df: int) -> float:
    """The chi-square(df) quantile at 1 - 1e-6 (Wilson-Hilferty: (X/df)^(1/3) is close to normal
    with mean 1 - 2/(9 df) and variance 2/(9 df); z = 4.753 is the normal 1 - 1e-6 quantile), so a
    correct sampler fails this test about once in a million runs."""
    return df * (1 - 2 / (9 * df) + 4.753 * np.sqrt(2 / (9 * df))) ** 3


def _chi_square(backend, prompt, params, lookup, table, runs: int, new: int) -> tuple[float, int]:
    """X^2 of the first `new` generated tokens over `runs` seeds against their exact distribution,
    cells of expected count < 5 pooled; and its degrees of freedom."""
    cond = np.stack([_exact_probabilities(table[t], params) for t in range(VOCAB)])
    exact = np.ones([VOCAB] * new)
    for step in range(new):
        shape = [1] * new
        if step == 0:
            shape[0] = VOCAB
            exact = exact * cond[prompt[-1]].reshape(shape)
        else:
            shape[step - 1], shape[step] = VOCAB, VOCAB
            exact = exact * cond.reshape(shape)
    counts = np.zeros([VOCAB] * new)
    for seed in range(runs):
        tokens = list(backend.generate(prompt, dataclasses.replace(params, seed=seed), new, frozenset(), lookup))
        counts[tuple(tokens)] += 1
    expected = (exact * runs).ravel()
    observed = counts.ravel()
    small = expected < 5
    cells_e = np.append(expected[~small], expected[small].sum())
    cells_o = np.append(observed[~small], observed[small].sum())
    keep = cells_e > 0
    x2 = float((((cells_o - cells_e) ** 2)[keep] / cells_e[keep]).sum())
    return x2, int(keep.sum()) - 1


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_lookup_keeps_the_distribution(top_k):
    """Fresh random bigram logits; a prompt whose repeats make drafts of every length. Under top-k 3
    some drafted tokens are outside the candidates (probability 0, always rejected)."""
    rng = np.random.default_rng()
    table = rng.standard_normal((VOCAB, VOCAB)) * 1.5
    params = SamplingParams(temperature=1.0, top_k=top_k)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    backend = CpuBackend(BigramModel(table))
    x2, df = _chi_square(backend, prompt, params, LookupParams(3), table, runs=20000, new=3)
    assert backend.lookup_stats.drafted > 0
    assert x2 < _chi_square_limit(df), (x2, df)


def test_the_distribution_test_catches_a_wrong_acceptance_rule(monkeypatch):
    """Resampling from p instead of the residual after a rejection over-weights the drafted token;
    the same test, same size, must see it."""
    from pynanoqwen.sampling import sample

    def resample_from_p(draft, logits, params, rng):
        out = []
        for i, drafted in enumerate(draft):
            p = _exact_probabilities(logits[i], params)
            if rng.random() < p[drafted]:
                out.append(int(drafted))
                continue
            out.append(sample(logits[i], params, rng))
            return out
        return out + [sample(logits[len(draft)], params, rng)]

    monkeypatch.setattr(backends, "accept_sampled", resample_from_p)
    rng = np.random.default_rng()
    table = rng.standard_normal((VOCAB, VOCAB)) * 0.3  # flat-ish: drafts are often rejected
    params = SamplingParams(temperature=1.0)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    x2, df = _chi_square(CpuBackend(BigramModel(table)), prompt, params, LookupParams(3), table, runs=20000, new=3)
    assert x2 > _chi_square_limit(df), (x2, df)


def test_the_lookup_bench_reports_acceptance_and_checks_identity(tmp_path, capsys):
    """bench/prompt_lookup.py end to end at a small size: every K's tokens match K = 0's."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "prompt_lookup_bench", Path(__file__).resolve().parent.parent / "bench" / "prompt_lookup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lookup.json"
    assert bench.main(["--prompts", "3", "--gen-tokens", "12", "--source-tokens", "100", "--repeat-tokens", "8",
                       "--draft-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("editing", "plain"):
        plain, looked_up = result["results"][name]
        assert looked_up["identical"] == 3 and looked_up["generated"] == plain["generated"]
        assert looked_up["passes"] == looked_up["verify_passes"] + looked_up["plain_steps"] <= plain["passes"]
    assert "| editing | 4 |" in capsys.readouterr().out
