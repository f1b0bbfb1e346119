"""Hugging Face Qwen2 checkpoint -> .nanoqwen file (`python -m pynanoqwen convert HF_DIR OUT`).

Every linear weight (and lm_head, unless --lm-head fp16) becomes INT4 (quant.quantize_int4);
embeddings, norms and biases become FP16. The tokenizer.json bytes and the chat template from
tokenizer_config.json (or chat_template.jinja) are embedded as they are.

Everything that can be checked without reading weights is checked before the output file is
started: config.json, the tokenizer, the index, every safetensors header, and the tensor set
against tensors.hf_tensors (no tensor missing, none extra, every shape right). Values are checked
while streaming: a NaN or Inf, or a value beyond FP16's range, stops the conversion naming the
tensor. fileformat.NanoQwenWriter writes a temp file and renames it only on success, so a failed
or interrupted (Ctrl-C) conversion leaves no output and an existing OUT untouched.

Reading safetensors: we parse the header ourselves (8-byte little-endian length, JSON with each
tensor's dtype, shape and byte range) and read each tensor's bytes with plain file reads, in
blocks of rows. numpy has no bfloat16, so `safetensors.numpy` cannot hand us BF16 tensors; a
BF16 value is the upper half of a float32, so widening it is a 16-bit shift. Plain reads (not
mmap) also keep the page cache out of our resident memory, so peak RSS measures what we hold.

Memory: the source is read and quantized in blocks of about 4M values, so the float32
temporaries stay near 100 MB; the output tensor is held whole because the writer takes whole
tensors. Peak memory is therefore near the largest output tensor (the 7B's FP16 embedding
table, 1.09 GB), never the model. The summary line reports the measured peak RSS.

Measured on the 7B preset (random BF16 weights, 4 shards, 15.23 GB; 2-core CPU shared with other
jobs): 161 s wall, peak RSS 1.17 GB, 4.74 GB written. The disk read (~95 MB/s here) is the limit:
CPU time was 38 s user + 33 s system.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from .checkpoint import bf16_bits_to_float32
from .config import GROUP_SIZE, ModelConfig
from .errors import CheckpointError
from .fileformat import NanoQwenWriter
from .quant import quantize_int4
from .tensors import QWEIGHT, SCALES, hf_tensors, is_quantized, stored_tensors

SAFETENSORS_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}  # bf16 is read as its bit patterns
BLOCK_ELEMENTS = 1 << 22  # source values read, checked and converted per step
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
FP16_MAX = float(np.finfo(np.float16).max)


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    tensors: int                # Hugging Face tensors converted
    input_bytes: int            # tensor data read (a tied model's INT4 lm_head reads the embedding again)
    output_bytes: int           # size of the .nanoqwen file
    seconds: float
    peak_rss_bytes: int         # the process's peak resident memory (getrusage)
    rss_growth_bytes: int       # peak RSS minus resident memory when the conversion started
    largest_output_tensor_bytes: int

    def summary(self) -> str:
        return (f"converted {self.tensors} tensors: read {_size(self.input_bytes)}, wrote "
                f"{_size(self.output_bytes)} in {self.seconds:.1f} s; peak RSS {_size(self.peak_rss_bytes)} "
                f"(+{_size(self.rss_growth_bytes)} during conversion; largest output tensor "
                f"{_size(self.largest_output_tensor_bytes)})")


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's data lies in a safetensors file."""
    name: str
    file: Path
    dtype: str          # "BF16", "F16" or "F32"
    shape: tuple[int, ...]
    offset: int         # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(SAFETENSORS_DTYPES[self.dtype]).itemsize


def convert_checkpoint(hf_dir: str | Path, out_path: str | Path, *, lm_head_int4: bool = True,
                       progress: bool = True) -> ConvertReport:
    """Convert the checkpoint in hf_dir to the .nanoqwen file out_path; prints a summary to stderr."""
    start_time = time.perf_counter()
    start_rss = _current_rss_bytes()
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    cfg = ModelConfig.from_hf_dir(hf_dir)
    tokenizer_json, chat_template = read_tokenizer(hf_dir, cfg)
    sources = index_checkpoint(hf_dir)
    check_tensor_set(cfg, sources)

    # HF name -> the source tensor it is made from; a tied model's INT4 lm_head is the embedding.
    plan: dict[str, SourceTensor] = {}
    for name in stored_tensors(cfg, lm_head_int4):
        hf_name = name.removesuffix(QWEIGHT).removesuffix(SCALES)
        tied_head = hf_name == "lm_head.weight" and cfg.tie_word_embeddings
        plan[hf_name] = sources["model.embed_tokens.weight" if tied_head else hf_name]
    input_bytes = sum(src.nbytes for src in plan.values())
    largest = 0

    from tqdm import tqdm

    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(open(path, "rb")) for path in {s.file for s in plan.values()}}
        bar = stack.enter_context(tqdm(total=input_bytes, unit="B", unit_scale=True,
                                       desc="convert", file=sys.stderr, disable=not progress,
                                       dynamic_ncols=True))
        writer = stack.enter_context(NanoQwenWriter(out_path, cfg, lm_head_int4=lm_head_int4,
                                                    tokenizer_json=tokenizer_json, chat_template=chat_template))
        for done, (hf_name, src) in enumerate(plan.items()):
            bar.set_postfix_str(f"tensor {done + 1}/{len(plan)}", refresh=False)
            blocks = read_blocks(src, files[src.file], bar)
            if is_quantized(hf_name, lm_head_int4):
                qweight, scales = quantize_blocks(hf_name, src.shape, blocks)
                writer.add_tensor(hf_name + QWEIGHT, qweight)
                writer.add_tensor(hf_name + SCALES, scales)
                largest = max(largest, qweight.nbytes + scales.nbytes)
            else:
                half = fp16_blocks(hf_name, src.shape, blocks)
                writer.add_tensor(hf_name, half)
                largest = max(largest, half.nbytes)

    peak_rss = _peak_rss_bytes()
    report = ConvertReport(tensors=len(plan), input_bytes=input_bytes, output_bytes=os.path.getsize(out_path),
                           seconds=time.perf_counter() - start_time, peak_rss_bytes=peak_rss,
                           rss_growth_bytes=max(0, peak_rss - start_rss), largest_output_tensor_bytes=largest)
    print(report.summary(), file=sys.stderr)
    return report


def read_tokenizer(hf_dir: Path, cfg: ModelConfig) -> tuple[bytes, str | None]:
    """tokenizer.json's bytes (checked to load, and to fit the vocabulary) and the chat template."""
    path = hf_dir / "tokenizer.json"
    try:
        tokenizer_json = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: the tokenizer is embedded in the .nanoqwen file") from None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as bad:  # tokenizers raises a bare Exception for malformed JSON or models
        first_line = str(bad).splitlines()[0] if str(bad) else type(bad).__name__
        raise CheckpointError(f"{path} cannot be loaded by tokenizers: {first_line}") from None
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if tokens > cfg.vocab_size:
        raise CheckpointError(f"{path} has {tokens} tokens but config.json's vocab_size is {cfg.vocab_size}")
    return tokenizer_json, read_chat_template(hf_dir)


def read_chat_template(hf_dir: Path) -> str | None:
    """The template from tokenizer_config.json, else chat_template.jinja (newer transformers), else None."""
    config_path = hf_dir / "tokenizer_config.json"
    if config_path.exists():
        try:
            template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as bad:
            raise CheckpointError(f"{config_path} is not a valid JSON object: {bad}") from None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{config_path}: chat_template is a {type(template).__name__}, not a string")
        if template is not None:
            return template
    jinja_path = hf_dir / "chat_template.jinja"
    return jinja_path.read_text(encoding="utf-8") if jinja_path.exists() else None


def index_checkpoint(hf_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the checkpoint (single file or shards + index), from the headers alone."""
    index_path = hf_dir / "model.safetensors.index.json"
    if not index_path.exists():
        single = hf_dir / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")
        return read_safetensors_header(single)

    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as bad:
        raise CheckpointError(f"{index_path} is not a valid index (a JSON object with a weight_map): "
                              f"{bad}") from None
    sources: dict[str, SourceTensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise CheckpointError(f"{index_path} names shard {shard!r}, not a file name in {hf_dir}")
        shard_path = hf_dir / shard
        if not shard_path.exists():
            raise CheckpointError(f"{shard_path} is listed in {index_path.name} but does not exist")
        for name, src in read_safetensors_header(shard_path).items():
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{shard_path.name} holds {name}, which {index_path.name} "
                                      f"maps to {weight_map.get(name)!r}")
            sources[name] = src
    for name, shard in weight_map.items():
        if name not in sources:
            raise CheckpointError(f"{index_path.name} maps {name} to {shard}, which does not hold it")
    return sources


def read_safetensors_header(path: Path) -> dict[str, SourceTensor]:
    """Parse and check one safetensors header: known dtypes, consistent sizes, data inside the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path} is not a safetensors file (truncated or corrupt header)")
            header = json.loads(f.read(header_len).decode("utf-8"))
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")

    data_start = 8 + header_len
    tensors: dict[str, SourceTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape + (begin, end)):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: tensor {name} has a malformed header entry {entry!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} is {dtype}; only BF16, F16 and F32 are supported")
        src = SourceTensor(name, path, dtype, shape, data_start + begin)
        if end - begin != src.nbytes:
            raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes but shape {list(shape)} "
                                  f"of {dtype} needs {src.nbytes}")
        if data_start + end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {data_start + end} "
                                  f"but the file has {size}")
        tensors[name] = src
    return tensors


def check_tensor_set(cfg: ModelConfig, sources: dict[str, SourceTensor]) -> None:
    """Exactly the tensors of hf_tensors(cfg), with its shapes; raises CheckpointError naming the first culprit."""
    expected = hf_tensors(cfg)
    missing = [name for name in expected if name not in sources]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]} is missing from the checkpoint{more}")
    extra = sorted(name for name in sources if name not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        hint = ("; config.json says tie_word_embeddings=true, which has no separate lm_head"
                if extra[0] == "lm_head.weight" else "")
        raise CheckpointError(f"unexpected tensor {extra[0]} in {sources[extra[0]].file.name}{more}: "
                              f"not part of a Qwen2 model with this config{hint}")
    for name, shape in expected.items():
        if sources[name].shape != shape:
            raise CheckpointError(f"tensor {name} in {sources[name].file.name} has shape "
                                  f"{list(sources[name].shape)}, config.json implies {list(shape)}")


def read_blocks(src: SourceTensor, f, bar):
    """Yield (first_row, float32 rows) of `src`, about BLOCK_ELEMENTS values at a time, checked finite."""
    row = math.prod(src.shape[1:])
    rows_per_block = max(1, BLOCK_ELEMENTS // row)
    dtype = np.dtype(SAFETENSORS_DTYPES[src.dtype])
    f.seek(src.offset)
    for first in range(0, src.shape[0], rows_per_block):
        rows = min(rows_per_block, src.shape[0] - first)
        raw = np.empty(rows * row, dtype=dtype)
        if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
            raise CheckpointError(f"{src.file} ended while reading tensor {src.name}")
        block = bf16_bits_to_float32(raw) if src.dtype == "BF16" else raw.astype(np.float32, copy=False)
        if not np.isfinite(block).all():
            bad = "NaN" if np.isnan(block).any() else "Inf"
            position = int(np.flatnonzero(~np.isfinite(block))[0]) // row + first
            raise CheckpointError(f"tensor {src.name} in {src.file.name} has {bad} values (row {position})")
        bar.update(raw.nbytes)
        yield first, block.reshape((rows,) + src.shape[1:])


def fp16_blocks(name: str, shape: tuple[int, ...], blocks) -> np.ndarray:
    """Assemble the FP16 tensor from float32 blocks, refusing values FP16 cannot hold."""
    out = np.empty(shape, dtype="<f2")
    for first, block in blocks:
        biggest = float(np.abs(block).max(initial=0.0))
        if biggest > FP16_MAX:
            raise CheckpointError(f"tensor {name} has a value of magnitude {biggest:.6g}, "
                                  f"beyond FP16's {FP16_MAX:g}")
        out[first:first + len(block)] = block
    return out


def quantize_blocks(name: str, shape: tuple[int, ...], blocks) -> tuple[np.ndarray, np.ndarray]:
    """Quantize [N, K] block by block into preallocated (qweight, scales)."""
    n, k = shape
    qweight = np.empty((n, k // 8), dtype="<u4")
    scales = np.empty((n, k // GROUP_SIZE), dtype="<f2")
    for first, block in blocks:
        q, s = quantize_int4(block)
        if not np.isfinite(s).all():
            raise CheckpointError(f"tensor {name} has a group whose largest value exceeds what an "
                                  f"FP16 scale can represent (7 x {FP16_MAX:g})")
        qweight[first:first + len(block)] = q
        scales[first:first + len(block)] = s
    return qweight, scales


def _current_rss_bytes() -> int:
    """Resident memory now, from /proc (Linux); the peak so far where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
