"""The baseline that `bench --baseline torch` runs beside us: transformers' Qwen2 in bf16 on the GPU.

Same weights (our INT4 weights dequantized, so both runtimes compute the same function up to
bf16 rounding), same prompt and lengths, greedy. transformers' `generate` with
`cache_implementation="static"` compiles the decode step with torch.compile (mode
"reduce-overhead": CUDA graphs) on the first call, which is the warm-up here and not timed.
Token times come from a streamer that stamps each token as generate hands it over.
"""

from __future__ import annotations

import time

import numpy as np

from . import bench_report
from .quant import SLOT_TO_WEIGHT
from .tensors import QWEIGHT, SCALES, hf_tensors, is_quantized


def _dequantize(torch, qweight: np.ndarray, scales: np.ndarray, device):
    """INT4 ValueShuffle words [N, K/8] + FP16 scales [N, K/128] -> bf16 [N, K] on `device`."""
    words = torch.from_numpy(np.ascontiguousarray(qweight).view(np.int32)).to(device)
    n, kw = words.shape
    slots = torch.stack([(words >> (4 * slot)) & 0xF for slot in range(8)], dim=-1)  # [N, K/8, 8] by slot
    codes = slots[..., np.argsort(SLOT_TO_WEIGHT).tolist()].reshape(n, kw * 8).to(torch.float32) - 8
    s = torch.from_numpy(np.ascontiguousarray(scales)).to(device).to(torch.float32)
    return (codes.view(n, -1, 128) * s[:, :, None]).reshape(n, kw * 8).to(torch.bfloat16)


def build_model(weights, device="cuda"):
    """A transformers Qwen2ForCausalLM in bf16 holding `weights` (anything with .config,
    .lm_head_int4 and .tensor(name): a NanoQwenFile or synthetic.SyntheticWeights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = weights.config
    hf_cfg = Qwen2Config(**cfg.to_hf_dict())
    # Built on the device in bf16 (random init, then overwritten): building on "meta" would leave
    # the rotary embedding's inv_freq, a buffer outside the state dict, without data.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    state = {}
    names = list(hf_tensors(cfg))
    if weights.lm_head_int4 and cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for name in names:
        if is_quantized(name, weights.lm_head_int4):
            state[name] = _dequantize(torch, weights.tensor(name + QWEIGHT), weights.tensor(name + SCALES), device)
        else:
            state[name] = torch.from_numpy(np.ascontiguousarray(weights.tensor(name))).to(device).to(torch.bfloat16)
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        model.config.tie_word_embeddings = False  # an INT4 lm_head differs from the FP16 embedding
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        model.tie_weights()
    return model.eval()


class _TokenClock:
    """A transformers streamer that records when each generated token reaches the host."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self.stamps.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


def torch_baseline(weights, settings, prompt: list[int]) -> dict:
    """TTFT / ITL / tokens/s of transformers on the same weights, prompt and lengths."""
    import torch

    if isinstance(weights, str):
        from .fileformat import NanoQwenFile

        weights = NanoQwenFile(weights)
    model = build_model(weights)
    ids = torch.tensor([prompt], device="cuda")

    def run():
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.gen_tokens,
                           min_new_tokens=settings.gen_tokens, do_sample=False, cache_implementation="static",
                           streamer=clock, pad_token_id=0)
        torch.cuda.synchronize()
        return clock.stamps, start

    run()  # compiles (torch.compile, CUDA graphs)
    ttfts, gaps, totals = [], [], []
    for _ in range(settings.repeats):
        stamps, start = run()
        ttfts.append(1e3 * (stamps[0] - start))
        gaps += [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
        totals.append(1e3 * (stamps[-1] - start))
    itl = bench_report.summarize(gaps)
    result = {"name": f"torch {torch.__version__} + transformers (bf16, static cache, compiled)",
              "ttft_ms": bench_report.summarize(ttfts), "itl_ms": itl, "decode_tok_s": 1e3 / itl["median"],
              "e2e_tok_s": settings.gen_tokens / (float(np.median(totals)) / 1e3),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model
    torch.cuda.empty_cache()
    return result
