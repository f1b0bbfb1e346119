"""Train tiny-coder, the model shipped in pynanoqwen/data/ that `generate` runs when no --model is given.

    OMP_NUM_THREADS=1 nice -n 10 python scripts/train_tiny_coder.py

What it does, top to bottom (main):
1. Corpus: the Python standard library's own .py files, the one body of Python source every
   machine with Python has. Test folders, `encodings` (mostly codec tables) and `pydoc_data` (one
   750 kB string) are left out: they are data, not code. Files are split by a hash of their path
   (pynanoqwen.data.is_held_out), so the held-out set is the same on every run and machine of one
   Python version.
2. Tokenizer: checkpoint.train_tokenizer, a byte-level BPE of VOCAB_SIZE tokens with Qwen2's
   pre-tokenizer and Qwen2.5's special tokens at ids 0..8 (trained on the top-level stdlib modules,
   so it has seen the held-out files' text; that shapes the vocabulary, not the model's weights).
   Files are joined with <|endoftext|>, Qwen2.5's end-of-document token.
3. Model: transformers' Qwen2ForCausalLM, CONFIG below (4 layers, hidden 256, GQA 4/2 heads,
   head_dim 64, tied embeddings), float32 on the CPU, one thread. AdamW, gradient clipping,
   bfloat16 autocast, in the PHASES below, each with its own linear warmup and cosine decay; a step
   of a phase is `batch` random windows of `seq_len` tokens of the training set, whose files are cut
   at some line ends first (token_stream says why). The first phase trains at 256 tokens (the first
   model's recipe), the second extends the context to CONTEXT = 2048 with the same tokens per step.
4. Held-out loss every --eval-every steps on EVAL_WINDOWS fixed windows of CONTEXT tokens, and at
   the end on all FINAL_EVAL_WINDOWS; the loss curve goes to train_log.json and docs/tiny_coder_loss.png.
5. The Hugging Face checkpoint (save_pretrained safetensors, tokenizer.json, tokenizer_config.json
   with the ChatML template), then `convert --lm-head fp16` into the shipped .nanoqwen file. The
   lm_head stays FP16: tied, it is the embedding table the file stores anyway (no extra bytes), and
   exact logits keep greedy tokens identical to transformers on the dequantized weights.
6. The held-out loss of the shipped INT4 file (numpy reference model), and a greedy sample.

The training record (settings, curve, losses, wall time) is docs/TINY_CODER.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

from pynanoqwen.config import ModelConfig
from pynanoqwen.data import EMBEDDED_MODEL, corpus_files, is_held_out, read_source

REPO = Path(__file__).resolve().parents[1]

VOCAB_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class Phase:
    steps: int
    seq_len: int
    batch: int
    peak_lr: float
    min_lr: float
    warmup: int


PHASES = (
    Phase(2000, 256, 8, 3e-3, 3e-4, 50),  # the first model's recipe (docs/TINY_CODER.md)
    # Context extension: 2,048 tokens a step as before, in one window 8 times longer. Training at
    # 2048 from the start (3000 steps, batch 1) reached a held-out loss of 4.52, these phases 3.96.
    Phase(600, 2048, 1, 5e-4, 1e-4, 20),
)
CONTEXT = PHASES[-1].seq_len  # long enough to hold a file the model is asked to edit (prompt lookup)
CONFIG = ModelConfig(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=64, vocab_size=VOCAB_SIZE, rope_theta=10000.0, max_position_embeddings=CONTEXT,
                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # <|endoftext|> ends a file
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
EVAL_WINDOWS = 8             # held-out windows measured during training
FINAL_EVAL_WINDOWS = 32      # ... and at the end (the held-out set has 57 windows of 2048 tokens)
LOG_EVERY = 10               # steps averaged into one point of the training curve
LINE_END_CUTS = 0.25         # share of a training file's newlines before which it is cut (token_stream)


# ----------------------------------------------------------------------------------------------
# Corpus (the file split is pynanoqwen.data's)

def token_stream(tokenizer, files: list[str], rng: np.random.Generator | None = None) -> np.ndarray:
    """The files' tokens, each file followed by <|endoftext|>, as one int64 array.

    With `rng` (the training set), each file is first cut before a random LINE_END_CUTS share of
    its newlines and the pieces are encoded separately. Why: Qwen2's pre-tokenizer glues newlines
    to the punctuation before them (":\n" is one token), so whole files never show the model a
    ":" token followed by a separate "\n" token; but that is exactly how a prompt typed by a user,
    "def fibonacci(n):", ends. Without the cuts the model treats the bare ":" as a rare token (in
    the first training run it answered "def fibonacci(n):" with a comment, " # Copy").
    """
    eot = tokenizer.token_to_id("<|endoftext|>")
    pieces, owners = [], []
    for index, path in enumerate(files):
        text = read_source(path)
        bounds = [0, len(text)]
        if rng is not None:
            newlines = np.array([m.start() for m in re.finditer("\n", text)], dtype=np.int64)
            bounds[1:1] = newlines[rng.random(len(newlines)) < LINE_END_CUTS].tolist()
        pieces += [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        owners += [index] * (len(pieces) - len(owners))
    ids: list[int] = []
    for owner, next_owner, encoding in zip(owners, owners[1:] + [None],
                                           tokenizer.encode_batch(pieces, add_special_tokens=False)):
        ids.extend(encoding.ids)
        if next_owner != owner:
            ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def eval_windows(stream: np.ndarray, count: int) -> np.ndarray:
    """`count` evenly spaced, non-overlapping CONTEXT-token windows of `stream`: [count, CONTEXT]."""
    chunks = stream[: len(stream) // CONTEXT * CONTEXT].reshape(-1, CONTEXT)
    if len(chunks) < count:
        raise SystemExit(f"the held-out set has {len(chunks)} windows of {CONTEXT} tokens, fewer than {count}")
    return chunks[np.linspace(0, len(chunks) - 1, count).round().astype(int)]


# ----------------------------------------------------------------------------------------------
# Training

def lr_at(step: int, phase: Phase) -> float:
    """Step `step` of `phase`: linear warmup to its peak, then cosine decay to its minimum at its last step."""
    if step < phase.warmup:
        return phase.peak_lr * (step + 1) / phase.warmup
    progress = (step - phase.warmup) / max(1, phase.steps - 1 - phase.warmup)
    return phase.min_lr + 0.5 * (phase.peak_lr - phase.min_lr) * (1 + math.cos(math.pi * progress))


def build_model(seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen2Config(**CONFIG.to_hf_dict())
    hf.torch_dtype = "float32"
    return Qwen2ForCausalLM._from_config(hf, attn_implementation="sdpa", dtype=torch.float32)


def held_out_loss(model, windows: np.ndarray) -> float:
    """Mean next-token cross-entropy (nats) over the windows, one window per forward pass."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(len(windows)):
            batch = torch.from_numpy(windows[first:first + 1])
            loss = model(input_ids=batch, labels=batch).loss
            total += loss.item() * len(batch)
            count += len(batch)
    model.train()
    return total / count


def train(model, train_stream: np.ndarray, eval_set: np.ndarray, eval_every: int, seed: int) -> dict:
    """Run the PHASES' optimizer steps (one AdamW throughout); returns the curves
    {"train": [[step, loss]], "held_out": [...]}, steps counted across phases."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms and biases
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=PHASES[0].peak_lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(seed)
    curves: dict[str, list] = {"train": [], "held_out": [[0, held_out_loss(model, eval_set)]]}
    window_losses: list[float] = []
    start = time.perf_counter()
    total_steps = sum(phase.steps for phase in PHASES)
    done = 0
    model.train()
    for phase in PHASES:
        for step in range(phase.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, phase)
            starts = rng.integers(0, len(train_stream) - phase.seq_len, phase.batch)
            batch = torch.from_numpy(np.stack([train_stream[s:s + phase.seq_len] for s in starts]))
            # bfloat16 matmuls (AVX512-BF16) take 2/3 of float32's step time here; weights, optimizer
            # state and the held-out loss stay float32.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            window_losses.append(loss.item())
            done += 1
            if done % LOG_EVERY == 0:
                curves["train"].append([done, float(np.mean(window_losses))])
                window_losses.clear()
                elapsed = time.perf_counter() - start
                print(f"step {done}/{total_steps} ({phase.batch} x {phase.seq_len})  loss "
                      f"{curves['train'][-1][1]:.3f}  lr {lr_at(step, phase):.2e}  {elapsed / done:.2f} s/step  "
                      f"elapsed {elapsed / 60:.1f} min", flush=True)
            if done % eval_every == 0 or done == total_steps:
                curves["held_out"].append([done, held_out_loss(model, eval_set)])
                print(f"step {done}  held-out loss {curves['held_out'][-1][1]:.3f}", flush=True)
    curves["train_seconds"] = time.perf_counter() - start
    return curves


# ----------------------------------------------------------------------------------------------
# Output

def save_checkpoint(model, tokenizer, out_dir: Path) -> None:
    """save_pretrained (safetensors; the tied lm_head is not stored) plus tokenizer files."""
    from pynanoqwen.checkpoint import tokenizer_config

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(CONFIG), indent=2) + "\n")


def quantized_held_out_loss(model_path: Path, windows: np.ndarray) -> float:
    """The same held-out loss measured on the shipped INT4 file with the numpy reference model."""
    from pynanoqwen.fileformat import NanoQwenFile
    from pynanoqwen.reference import ReferenceModel

    with NanoQwenFile(model_path) as f:
        model = ReferenceModel(f)
        losses = []
        for window in windows:
            model.reset()
            logits = model.forward(window[:-1]).astype(np.float64)
            log_z = np.logaddexp.reduce(logits, axis=1)
            losses.append(np.mean(log_z - logits[np.arange(len(window) - 1), window[1:]]))
        del model
    return float(np.mean(losses))


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(*zip(*curves["train"]), label=f"train (mean of {LOG_EVERY} steps)", linewidth=1)
    ax.plot(*zip(*curves["held_out"]), "o-", label=f"held-out ({EVAL_WINDOWS} windows)", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"tiny-coder: {CONFIG.num_layers} layers, hidden {CONFIG.hidden_size}; "
                 + " then ".join(f"{p.steps} steps of {p.batch} x {p.seq_len}" for p in PHASES), fontsize=10)
    ax.set_ylim(top=min(9.0, max(loss for _, loss in curves["held_out"]) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def greedy_sample(model_path: Path, prompt: str, tokens: int) -> str:
    from pynanoqwen.backends import CpuBackend
    from pynanoqwen.fileformat import NanoQwenFile
    from pynanoqwen.reference import ReferenceModel
    from pynanoqwen.sampling import SamplingParams
    from pynanoqwen.tokenizer import Tokenizer

    with NanoQwenFile(model_path) as f:
        tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, vocab_size=f.config.vocab_size)
        backend = CpuBackend(ReferenceModel(f))
        ids = tokenizer.encode(prompt)
        out = list(backend.generate(ids, SamplingParams(), tokens, tokenizer.stop_ids))
        del backend
    return prompt + tokenizer.decode(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=REPO / "out" / "tiny-coder",
                        help="where the Hugging Face checkpoint and train_log.json go")
    parser.add_argument("--model-out", type=Path, default=EMBEDDED_MODEL)
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "tiny_coder_loss.png")
    args = parser.parse_args()

    import torch

    from pynanoqwen.checkpoint import train_tokenizer
    from pynanoqwen.convert import convert_checkpoint

    torch.set_num_threads(1)  # the record's wall time is for one thread; it is also deterministic
    wall_start = time.perf_counter()
    tokenizer = train_tokenizer(VOCAB_SIZE)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    files = corpus_files()
    held_out = [f for f in files if is_held_out(f)]
    train_files = [f for f in files if not is_held_out(f)]
    train_stream = token_stream(tokenizer, train_files, np.random.default_rng(args.seed))
    held_out_stream = token_stream(tokenizer, held_out)
    print(f"corpus: {len(train_files)} train files ({len(train_stream):,} tokens), {len(held_out)} held-out "
          f"files ({len(held_out_stream):,} tokens); tokenizer {VOCAB_SIZE} tokens, "
          f"{time.perf_counter() - wall_start:.1f} s", flush=True)

    model = build_model(args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters", flush=True)
    final_set = eval_windows(held_out_stream, FINAL_EVAL_WINDOWS)
    eval_set = final_set[np.linspace(0, FINAL_EVAL_WINDOWS - 1, EVAL_WINDOWS).round().astype(int)]
    curves = train(model, train_stream, eval_set, args.eval_every, args.seed)
    final_held_out = held_out_loss(model, final_set)

    save_checkpoint(model, tokenizer, args.work_dir / "hf")
    args.model_out.parent.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(args.work_dir / "hf", args.model_out, lm_head_int4=False, progress=False)
    int4_held_out = quantized_held_out_loss(args.model_out, final_set)
    sample = greedy_sample(args.model_out, "def fibonacci(n):", 60)

    record = {
        "python": platform.python_version(), "torch": torch.__version__,
        "phases": [dataclasses.asdict(phase) for phase in PHASES], "weight_decay": WEIGHT_DECAY, "seed": args.seed, "parameters": params,
        "train_files": len(train_files), "held_out_files": len(held_out),
        "train_tokens": len(train_stream), "held_out_tokens": len(held_out_stream),
        "curves": {"train": curves["train"], "held_out": curves["held_out"]},
        "train_seconds": curves["train_seconds"],
        "final_train_loss": curves["train"][-1][1],
        "final_held_out_loss": final_held_out, "final_held_out_windows": FINAL_EVAL_WINDOWS,
        "int4_held_out_loss": int4_held_out, "file_bytes": args.model_out.stat().st_size,
        "sample": sample, "wall_seconds": time.perf_counter() - wall_start,
    }
    (args.work_dir / "train_log.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(curves, args.plot)
    print(json.dumps({k: v for k, v in record.items() if k != "curves"}, indent=2), flush=True)


if __name__ == "__main__":
    sys.exit(main())
