"""Gates that compare the GPU engine's outputs with the reference's, and the limits they use.

Every limit here comes from the path's arithmetic and from the reference's own outputs; nothing
measured on the output under test sets a threshold. Each is a derived bound or a stated estimate:

LAYER_ERROR, relative L2 error of one decoder layer's update (output - input) per position:
- prmt (bound): activations rounded to FP16 where the GEMVs read them (xn before QKV and gate-up,
  attn, the MLP product), K and V stored in FP16, each a relative error of at most u16 = 2^-11,
  and the FP16 accumulation of 16 products per half: eight roundings, 8 u16 = 3.9e-3.
- auto (bound): the GEMVs but down_proj run fixed16 (kernels/gemv_int4_paths.py), which reads xn
  unrounded and sums exactly; its rounding of x to 16 bits per chunk of 32 is at most
  max/65534 + 2^-22 |x| per input, a relative L2 error over the chunk of at most sqrt(32)/65534 +
  2^-22 = 8.7e-5 < u16/4. So: attn, the MLP product, K and V in FP16 (4 u16), four fixed16
  roundings (< 1 u16), and down_proj's FP16 accumulation on prmt (at most prmt's 2 u16 for it):
  7 u16 = 3.4e-3.
- dp4a (estimate): each GEMV input is rounded to INT8 per group of 128, an error uniform within
  +-max/254, whose RMS is max/440, so a relative RMS error of (max/rms)/440 per input; four inputs
  in series (xn, attn, xn, MLP product) with max/rms <= 8: 4 x 8/440 = 7.3e-2. An RMS figure under
  an assumption on the activations, so an estimate; a numpy emulation of this arithmetic at 7B
  dims gave 2.0e-2, the GPU 1.5e-2 to 2.7e-2 (docs/PERFORMANCE.md).
- prefill (bound): the batched path's roundings: xn twice, the dequantized weights (w s rounded
  once), q, K and V, the softmax weights P, attn, the MLP product, plus one for the float32 sums:
  10 u16 = 4.9e-3.

Logits. The errors of the L layers' updates add up in the residual stream; `logits_error`
estimates the relative error of the final hidden state, and so of the logits, as the sum of the
per-layer figures, plus one GEMV input's rounding for the lm_head (no amplification by later
layers is modelled: an estimate). Measured relative errors of a correct engine sit 5-10x under it
(docs/PERFORMANCE.md). Modelled as noise, each logit of a row is then off by about
eps x sigma (sigma: the standard deviation of the reference row's logits), which gives:

- KL gate: KL(p_ref || p_gpu) ~ 1/2 Var_p(Delta z) ~ 1/2 (eps sigma)^2, while KL(p_ref || uniform)
  is sigma^2 / 2 for Gaussian logits and more for peaked ones. So kl_ratio, the summed KL over the
  summed KL to the uniform distribution, should stay below eps^2; the limit is (KL_FACTOR eps)^2.
  An all-zero (any constant) output has a ratio of exactly 1, a shuffled one at least 1 in
  expectation (E over shuffles of -log q is the mean of -log q over the vocabulary, >= log V):
  both fail whenever the limit is below 1. A limit of 1 or more cannot tell a correct engine from
  garbage; the check then reports the figures as a comparison and passes nothing (dp4a at 7B).
- Clear rows: the top-1 of a row can change only if the error of its top two logits' difference
  (about sqrt(2) eps sigma) exceeds the reference's lead. A row is clear when that lead exceeds
  CLEAR_SIGMAS sqrt(2) eps sigma of the reference row; on clear rows top-1 must agree everywhere.
"""

from __future__ import annotations

import math

import numpy as np

from .oracles import U16, Check, passed, skipped

LAYER_ERROR = {"auto": 7 * U16, "prmt": 8 * U16, "dp4a": 4 * 8 / 440, "prefill": 10 * U16}
# One GEMV's share: its input rounding (auto's lm_head runs fixed16: < u16/4, above).
GEMV_INPUT_ERROR = {"auto": U16 / 4, "prmt": 2 * U16, "dp4a": 8 / 440}
KL_FACTOR = 2.0  # safety on the KL estimate (the measured ratios sit far lower)
CLEAR_SIGMAS = 6.0  # a Gaussian error this many sigmas out: 1e-9 per row


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Worst row of ||ours - theirs|| / ||theirs|| (rows: last axis)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)))


def logits_error(path: str, num_layers: int, lm_head_path: str | None = None) -> float:
    """The estimated relative error of the logits of `num_layers` layers on `path` (the module
    docstring), the lm_head on lm_head_path (by default `path`; the prefill path ends in a GEMV)."""
    return num_layers * LAYER_ERROR[path] + GEMV_INPUT_ERROR[lm_head_path or path]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_ratio(reference: np.ndarray, logits: np.ndarray, base: np.ndarray | None = None) -> float:
    """sum over rows of KL(p_base || p) / sum of KL(p_ref || uniform), rows on the last axis; the
    base distribution is the reference's unless another output is given."""
    log_r = _log_softmax(reference)
    log_b = log_r if base is None else _log_softmax(base)
    p, p_ref = np.exp(log_b), np.exp(log_r)
    kl = np.sum(p * (log_b - _log_softmax(logits)), axis=-1)
    kl_uniform = np.sum(p_ref * log_r, axis=-1) + math.log(reference.shape[-1])
    return float(kl.sum() / max(kl_uniform.sum(), np.finfo(np.float64).tiny))


def clear_margin(reference: np.ndarray, eps: float) -> np.ndarray:
    """The lead a reference row's winner needs to count as clear (module docstring), per row."""
    return CLEAR_SIGMAS * math.sqrt(2) * eps * np.std(np.asarray(reference, np.float64), axis=-1)


def clear_rows(reference: np.ndarray, eps: float) -> np.ndarray:
    """Rows whose reference top-1 leads its top-2 by more than clear_margin."""
    top2 = np.sort(np.asarray(reference, np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0] > clear_margin(reference, eps)


def logits_check(name: str, ours: np.ndarray, reference: np.ndarray, eps: float, what: str,
                 base: np.ndarray | None = None) -> Check:
    """The KL gate and top-1 on clear rows of `ours` against `reference` (rows on the last axis),
    for an estimated relative error eps; `what` says what the rows are, for the detail. With
    `base`, another output under test, ours is compared with base instead (KL(p_base || p_ours),
    top-1 against base's), the rows, their margins and the scale still the reference's, and eps
    the sum of both outputs' estimates."""
    ratio, limit = kl_ratio(reference, ours, base), (KL_FACTOR * eps) ** 2
    agree = np.argmax(ours, axis=-1) == np.argmax(reference if base is None else base, axis=-1)
    clear = clear_rows(reference, eps)
    figures = (f"{what}: KL ratio {ratio:.1e} (limit {limit:.1e}, garbage >= 1); top-1 agreement "
               f"{agree.mean():.1%}, {agree[clear].mean() if clear.any() else 1:.0%} on the {int(clear.sum())} rows "
               f"the reference leads by {CLEAR_SIGMAS:.0f} sqrt(2) x {eps:.2g} sigma (must be 100%); relative error "
               f"{relative_error(ours, reference):.2e}")
    if limit >= 1:
        return skipped(name, f"a comparison, not a gate: the estimated error {eps:.2f} of this path at this depth "
                             f"cannot tell a correct engine from an all-zero output; {figures}")
    return passed(name, ratio < limit and bool(agree[clear].all()), figures)
