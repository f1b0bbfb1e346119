"""Random models of any shape, without a Hugging Face checkpoint: as a file or straight in memory.

For the GPU engine's tests and benchmarks: a 7B-shaped model is made on the GPU machine itself
instead of being shipped. Two forms with the same values:

- `SyntheticWeights(cfg or preset name, seed)`: a WeightSource (reference.WeightSource: .config,
  .lm_head_int4, .tensor(name)) that makes each tensor when asked for it. The engine, the
  reference model and the torch baseline read it like a NanoQwenFile; no disk involved.
- `write_synthetic_nanoqwen(path, cfg, seed)`: the same tensors through filewriter.NanoQwenWriter,
  with checkpoint.train_tokenizer's small BPE (bos/eos become its ids, as make_checkpoint does).

Weights follow pynanoqwen/checkpoint.py's recipe: N(0, 0.02) for embeddings, linears, lm_head and
QKV biases, 1 + N(0, 0.02) for RMSNorm weights. Linears go through quant.quantize_int4 exactly as
`convert` does. Each tensor is generated and quantized in row blocks of ~4M values by a thread
pool (numpy's normal generator and ufuncs release the GIL), each block from its own generator
seeded by (seed, tensor index, block index): the values do not depend on the number of threads.
Measured on a 2-core machine: the 7B file in 169 s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .checkpoint import INIT_STD, MAX_TOKENIZER_VOCAB, train_tokenizer
from .config import GROUP_SIZE, ModelConfig, preset
from .filewriter import NanoQwenWriter
from .quant import quantize_int4
from .tensors import QWEIGHT, SCALES, stored_tensors

BLOCK_VALUES = 1 << 22  # float32 values generated per task (16 MB)


class SyntheticWeights:
    """Random weights of shape `model` (a ModelConfig or a preset name), made on demand.

    `tensor(name)` takes the names of tensors.stored_tensors. An INT4 linear's qweight and scales
    come from one quantization; the pair is kept until its other half has been asked for.
    """

    def __init__(self, model: ModelConfig | str, seed: int = 0, *, lm_head_int4: bool = True,
                 progress: bool = False, workers: int | None = None):
        self.config = preset(model) if isinstance(model, str) else model.validate()
        self.lm_head_int4 = lm_head_int4
        self.seed = seed
        self._expected = stored_tensors(self.config, lm_head_int4)
        self.names = list(self._expected)
        self._index = {name: index for index, name in enumerate(self.names)}
        self._pending: dict[str, np.ndarray] = {}  # the half of an INT4 pair not handed out yet
        self._workers = workers or os.cpu_count()
        self._progress = None
        if progress:
            from tqdm import tqdm

            self._progress = tqdm(total=len(self.names), desc="random weights", unit="tensor")

    def nbytes(self, name: str) -> int:
        dtype, shape = self._expected[name]
        return math.prod(shape) * np.dtype(dtype).itemsize

    def tensor(self, name: str) -> np.ndarray:
        if name in self._pending:
            array = self._pending.pop(name)
        elif name.endswith((QWEIGHT, SCALES)):
            base = name[:-len(QWEIGHT)] if name.endswith(QWEIGHT) else name[:-len(SCALES)]
            n, k = self._expected[base + QWEIGHT][1]
            qweight, scales = _random_int4(self._workers, n, k * 8, self.seed, self._index[base + QWEIGHT])
            pair = {base + QWEIGHT: qweight, base + SCALES: scales}
            array = pair.pop(name)
            self._pending.update(pair)
        else:
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            array = _random_fp16(self._workers, self._expected[name][1], self.seed, self._index[name], offset)
        if self._progress is not None:
            self._progress.update(1)
        return array


def write_synthetic_nanoqwen(path, cfg: ModelConfig, seed: int = 0, *, lm_head_int4: bool = True,
                             workers: int | None = None) -> ModelConfig:
    """Write SyntheticWeights(cfg, seed) as a .nanoqwen file; returns the config stored (bos/eos
    replaced by the tokenizer's ids)."""
    tokenizer = train_tokenizer(min(cfg.vocab_size * 15 // 16, MAX_TOKENIZER_VOCAB))
    cfg = dataclasses.replace(cfg, bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
                              eos_token_id=tokenizer.token_to_id("<|im_end|>")).validate()
    weights = SyntheticWeights(cfg, seed, lm_head_int4=lm_head_int4, workers=workers)
    with NanoQwenWriter(Path(path), cfg, lm_head_int4=lm_head_int4, tokenizer_json=tokenizer.to_str().encode(),
                        chat_template=None) as writer:
        for name in weights.names:
            writer.add_tensor(name, weights.tensor(name))
    return cfg


def _row_blocks(rows: int, row_values: int) -> list[slice]:
    per_block = max(1, BLOCK_VALUES // row_values)
    return [slice(start, min(start + per_block, rows)) for start in range(0, rows, per_block)]


def _normal(seed: int, index: int, block: int, shape: tuple[int, ...]) -> np.ndarray:
    values = np.random.default_rng([seed, index, block]).standard_normal(shape, dtype=np.float32)
    values *= np.float32(INIT_STD)
    return values


def _random_int4(workers: int, n: int, k: int, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """qweight uint32 [n, k/8] and scales float16 [n, k/128] of a random N(0, 0.02) matrix."""
    qweight = np.empty((n, k // 8), dtype=np.uint32)
    scales = np.empty((n, k // GROUP_SIZE), dtype=np.float16)

    def fill(block: int, rows: slice) -> None:
        qweight[rows], scales[rows] = quantize_int4(_normal(seed, index, block, (rows.stop - rows.start, k)))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fill, *zip(*enumerate(_row_blocks(n, k)))))
    return qweight, scales


def _random_fp16(workers: int, shape: tuple[int, ...], seed: int, index: int, offset: float) -> np.ndarray:
    out = np.empty(shape, dtype=np.float16)
    rows = out.reshape(shape[0], -1)

    def fill(block: int, part: slice) -> None:
        values = _normal(seed, index, block, (part.stop - part.start, rows.shape[1]))
        rows[part] = values + np.float32(offset) if offset else values

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fill, *zip(*enumerate(_row_blocks(shape[0], math.prod(shape[1:]))))))
    return out
