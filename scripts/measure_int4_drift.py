"""How far INT4 quantization moves the logits of the `tiny` model away from its unquantized weights.

For each seed: build a random `tiny` checkpoint (random_hf_weights), run transformers'
Qwen2ForCausalLM in float64 on the original float weights and the numpy reference model on the
INT4 weights (reference.InMemoryWeights.quantize, exactly what `convert` stores), over the same
POSITIONS random tokens, and compare the logits: relative L2 error, top-1 agreement and the KL
divergence KL(unquantized || INT4) per position. Both lm_head settings of `convert` are measured.

The figures are recorded in docs/QUANTIZATION.md; tests/test_reference.py imports this module
for its random checkpoint and transformers model, and re-measures seed 0 against that record.
Needs the test extra (torch, transformers).

    python scripts/measure_int4_drift.py --seeds 10
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pynanoqwen.config import PRESETS, ModelConfig
from pynanoqwen.quant import dequantize_int4, quantize_int4
from pynanoqwen.reference import InMemoryWeights, ReferenceModel
from pynanoqwen.tensors import hf_tensors

POSITIONS = 64
LOGIT_STD = 4.0  # peaked softmaxes; at the usual 0.02 init std the logits have std 0.32: near uniform


def random_hf_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names, scaled so activations and logits keep useful sizes.

    Linear weights have std 1/sqrt(in_features), so activations keep their size through the layers;
    embeddings are unit normal, norm weights 1 + N(0, 0.1), biases N(0, 0.1), and lm_head has std
    LOGIT_STD/sqrt(hidden) so that the logits of the unit-RMS final hidden state have std LOGIT_STD
    and greedy argmax margins are not razor thin.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_tensors(cfg).items():
        if name == "lm_head.weight":
            std = LOGIT_STD / np.sqrt(cfg.hidden_size)
        elif name == "model.embed_tokens.weight":
            std = 1.0
        elif name.endswith("_proj.weight"):
            std = 1.0 / np.sqrt(shape[1])
        else:
            std = 0.1
        w = rng.normal(0.0, std, size=shape)
        out[name] = (w + 1.0 if name.endswith("norm.weight") else w).astype(np.float32)
    return out


def hf_model(cfg: ModelConfig, hf_weights: dict[str, np.ndarray]) -> Qwen2ForCausalLM:
    """transformers' Qwen2ForCausalLM in float64 (eager attention) holding `hf_weights`.

    float64 so that it is the exact side of every comparison (transformers still rounds RMSNorm,
    the softmax and the RoPE angles to float32 inside; those errors are below 1e-6 relative).
    """
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**cfg.to_hf_dict()), attn_implementation="eager",
                                          dtype=torch.float64)
    state = {name: torch.from_numpy(np.asarray(w, dtype=np.float64)) for name, w in hf_weights.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_logits(model: Qwen2ForCausalLM, tokens) -> np.ndarray:
    """Logits [len(tokens), vocab] of one full forward pass (no cache), as float64."""
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)]), use_cache=False)
    return out.logits[0].double().numpy()


@dataclasses.dataclass(frozen=True)
class Drift:
    rel_l2: float          # ||int4 - fp|| / ||fp|| over all logits
    max_row_rel_l2: float  # the same per position, worst position
    top1_agreement: float  # fraction of positions where both argmaxes agree
    mean_kl: float         # KL(fp || int4) in nats, mean over positions
    max_kl: float          # ... worst position


def compare(fp: np.ndarray, q: np.ndarray) -> Drift:
    """Drift of logits q from logits fp, both [positions, vocab]."""
    fp, q = fp.astype(np.float64), q.astype(np.float64)
    row_rel = np.linalg.norm(q - fp, axis=1) / np.linalg.norm(fp, axis=1)
    log_p = fp - np.logaddexp.reduce(fp, axis=1, keepdims=True)
    log_q = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=1)
    return Drift(rel_l2=float(np.linalg.norm(q - fp) / np.linalg.norm(fp)),
                 max_row_rel_l2=float(row_rel.max()),
                 top1_agreement=float(np.mean(fp.argmax(axis=1) == q.argmax(axis=1))),
                 mean_kl=float(kl.mean()), max_kl=float(kl.max()))


def measure_drift(seed: int, lm_head_int4: bool, cfg: ModelConfig = PRESETS["tiny"]) -> Drift:
    """Drift of the INT4 reference model from the unquantized float64 model, `tiny`, one seed."""
    weights = random_hf_weights(cfg, seed)
    tokens = np.random.default_rng(seed + 1_000_000).integers(0, cfg.vocab_size, POSITIONS)
    unquantized = hf_logits(hf_model(cfg, weights), tokens)
    int4 = ReferenceModel(InMemoryWeights.quantize(cfg, weights, lm_head_int4)).forward(tokens)
    return compare(unquantized, int4)


def weight_error(seed: int, cfg: ModelConfig = PRESETS["tiny"]) -> float:
    """||W' - W|| / ||W|| over every layer linear of the seed's checkpoint: the noise INT4 adds."""
    weights = random_hf_weights(cfg, seed)
    linears = [name for name in weights if name.endswith("_proj.weight")]
    squared_error = sum(np.sum((dequantize_int4(*quantize_int4(weights[n])) - weights[n]) ** 2) for n in linears)
    return float(np.sqrt(squared_error / sum(np.sum(weights[n] ** 2) for n in linears)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="random checkpoints to measure")
    args = parser.parse_args()
    seeds = range(args.seeds)
    errors = [weight_error(seed) for seed in seeds]
    print(f"INT4 weight error ||W'-W||/||W|| of the layer linears: mean {np.mean(errors):.4g}, "
          f"max {np.max(errors):.4g}\n")
    fields = [f.name for f in dataclasses.fields(Drift)]
    print("| lm_head | seed | " + " | ".join(fields) + " |")
    print("|---" * (len(fields) + 2) + "|")
    for lm_head_int4 in (False, True):
        runs = [measure_drift(seed, lm_head_int4) for seed in seeds]
        rows = [(str(seed), drift) for seed, drift in zip(seeds, runs)]
        rows.append(("mean", Drift(**{f: float(np.mean([getattr(d, f) for d in runs])) for f in fields})))
        rows.append(("worst", Drift(**{f: (min if f == "top1_agreement" else max)(getattr(d, f) for d in runs)
                                       for f in fields})))
        for label, drift in rows:
            print(f"| {'int4' if lm_head_int4 else 'fp16'} | {label} | "
                  + " | ".join(f"{getattr(drift, f):.4g}" for f in fields) + " |")


if __name__ == "__main__":
    main()
