"""Hugging Face Qwen2 checkpoint -> .nanoqwen file (`python -m pynanoqwen convert HF_DIR OUT`).

Every linear weight (and lm_head, unless --lm-head fp16) becomes INT4 (quant.quantize_int4);
embeddings, norms and biases become FP16. The tokenizer.json bytes and the chat template from
tokenizer_config.json (or chat_template.jinja) are embedded as they are.

Everything that can be checked without reading weights is checked before the output file is
started: OUT itself (never one of the input files or inside HF_DIR; an existing OUT is replaced
only with overwrite=True, which the command passes for --force), config.json, the tokenizer and its chat template (which
must compile), generation_config.json's end-of-generation ids, the index, every safetensors
header, and the tensor set against tensors.hf_tensors (no tensor missing, none extra, every shape
right). Values are checked while streaming: a NaN or Inf, or a value beyond FP16's range, stops
the conversion naming the tensor. filewriter.NanoQwenWriter writes a temp file and renames it only
on success, so a failed or interrupted (Ctrl-C, SIGTERM, SIGHUP) conversion leaves no output and
an existing OUT untouched. Temp files of earlier conversions that were killed outright (SIGKILL,
a crash of the machine) are named at the start, never removed: they are not this run's.

Reading safetensors: we parse the header ourselves (8-byte little-endian length, JSON with each
tensor's dtype, shape and byte range) and read each tensor's bytes with plain file reads, in
blocks of rows. numpy has no bfloat16, so `safetensors.numpy` cannot hand us BF16 tensors; a
BF16 value is the upper half of a float32, so widening it is a 16-bit shift. Plain reads (not
mmap) also keep the page cache out of our resident memory, so peak RSS measures what we hold.

Memory: the source is read and quantized in blocks of about 4M values, so the float32
temporaries stay near 100 MB; the output tensor is held whole because the writer takes whole
tensors. Peak memory is therefore near the largest output tensor (the 7B's FP16 embedding
table, 1.09 GB), never the model. The summary line reports the measured peak RSS.

The README quotes the summary lines measured on the 7B preset (time, peak RSS, bytes read and
written, on a 2-core VM and on the 16-core H200 machine); they are kept there only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .checkpoint import bf16_bits_to_float32
from .config import GROUP_SIZE, ModelConfig, hf_eos_token_ids, read_file_bytes, read_json_object, resolved
from .errors import CheckpointError, ConfigError, FormatError
from .fileformat import MAX_EXTRA_EOS
from .filewriter import NanoQwenWriter, leftover_temp_files
from .quant import quantize_int4
from .tensors import QWEIGHT, SCALES, hf_tensors, is_quantized, stored_tensors
from .tokenizer import compile_chat_template

SAFETENSORS_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}  # bf16 is read as its bit patterns
BLOCK_ELEMENTS = 1 << 22  # source values read, checked and converted per step
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
FP16_MAX = float(np.finfo(np.float16).max)
# Signals that end a conversion the way Ctrl-C does (the temp file is removed), exit code 128 + signal.
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


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
        """One line of the figures a user plans by: time, peak memory and the file's size."""
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
                       progress: bool = True, overwrite: bool = True) -> ConvertReport:
    """Convert the checkpoint in hf_dir to the .nanoqwen file out_path; prints a summary to stderr.

    overwrite=False refuses an existing out_path (the command's default; --force passes True).
    An existing file is only ever replaced by a complete new one, atomically."""
    # Path("") is ".": an empty HF_DIR was taken for the current directory, an empty OUT reported as one.
    if not str(hf_dir).strip():
        raise CheckpointError("the checkpoint directory HF_DIR is empty; give a Hugging Face checkpoint directory")
    if not str(out_path).strip():
        raise CheckpointError("the output path OUT is empty; give the path of the .nanoqwen file to write")
    with _signals_unwind(CLEANUP_SIGNALS):
        return _convert(Path(hf_dir), Path(out_path), lm_head_int4, progress, overwrite)


def _convert(hf_dir: Path, out_path: Path, lm_head_int4: bool, progress: bool, overwrite: bool) -> ConvertReport:
    start_time = time.perf_counter()
    start_rss = _current_rss_bytes()
    try:  # a name too long for the file system raises OSError, where a missing one is just False
        if not hf_dir.is_dir():
            raise CheckpointError(f"{hf_dir} is not a directory")
        check_output_path(hf_dir, out_path, overwrite)
    except OSError as err:
        raise CheckpointError(f"{err.filename}: {err.strerror or err}") from None
    note_leftover_temp_files(out_path)
    hf_config = read_json_object(hf_dir / "config.json", ConfigError)
    cfg = ModelConfig.from_hf_dict(hf_config)
    tokenizer_json, chat_template = read_tokenizer(hf_dir, cfg)
    extra_eos_ids = read_extra_eos_ids(hf_dir, hf_config, cfg)
    sources = index_checkpoint(hf_dir)
    check_not_an_input(out_path, {src.file for src in sources.values()} | set(hf_dir.glob("*.json"))
                       | set(hf_dir.glob("*.jinja")))
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
                                                    tokenizer_json=tokenizer_json, chat_template=chat_template,
                                                    extra_eos_ids=extra_eos_ids))
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
        tokenizer_json = read_file_bytes(path, CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: the tokenizer is embedded in the .nanoqwen file") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
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
    """The template from tokenizer_config.json, else chat_template.jinja (newer transformers), else
    None; a template that does not compile is refused here, not at the first `generate --chat`."""
    config_path = hf_dir / "tokenizer_config.json"
    template = None
    if config_path.exists():
        template = read_json_object(config_path, CheckpointError).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{config_path}: chat_template is a {type(template).__name__}, not a string")
    source = config_path
    jinja_path = hf_dir / "chat_template.jinja"
    if template is None and jinja_path.exists():
        source = jinja_path
        try:
            template = read_file_bytes(jinja_path, CheckpointError).decode("utf-8")
        except OSError as err:
            raise CheckpointError(f"cannot read {jinja_path}: {err.strerror or err}") from None
        except UnicodeDecodeError as bad:
            raise CheckpointError(f"{jinja_path} is not UTF-8 text ({bad.reason} at byte {bad.start})") from None
    if template is not None:
        try:
            compile_chat_template(template)
        except FormatError as bad:
            raise CheckpointError(f"{source}: {bad}") from None
    return template


def read_extra_eos_ids(hf_dir: Path, hf_config: dict, cfg: ModelConfig) -> tuple[int, ...]:
    """The end-of-generation ids besides cfg.eos_token_id: the rest of config.json's eos_token_id
    when it is a list, then generation_config.json's eos_token_id (an id or a list), each once."""
    ids = hf_eos_token_ids(hf_config["eos_token_id"], "config.json") if "eos_token_id" in hf_config else []
    path = hf_dir / "generation_config.json"
    if path.exists():
        generation = read_json_object(path, CheckpointError)
        if generation.get("eos_token_id") is not None:
            try:
                ids += hf_eos_token_ids(generation["eos_token_id"], path.name)
            except ConfigError as bad:
                raise CheckpointError(str(bad)) from None
    extra = tuple(dict.fromkeys(i for i in ids if i != cfg.eos_token_id))
    for token in extra:
        if token >= cfg.vocab_size:
            raise CheckpointError(f"end-of-generation id {token} (config.json or {path.name}) is not a token id "
                                  f"of the {cfg.vocab_size}-token vocabulary")
    if len(extra) > MAX_EXTRA_EOS:
        raise CheckpointError(f"config.json and {path.name} name {len(extra)} end-of-generation ids besides "
                              f"eos_token_id; a .nanoqwen file holds at most {MAX_EXTRA_EOS}")
    return extra


def check_output_path(hf_dir: Path, out_path: Path, overwrite: bool) -> None:
    """Refuse an OUT inside the checkpoint, an OUT that is a directory, a device or a FIFO or whose
    directory is missing, and an existing OUT unless `overwrite`."""
    where = resolved(out_path)
    if where.is_relative_to(resolved(hf_dir)):
        raise CheckpointError(f"{out_path} is inside the checkpoint directory {hf_dir}; write the "
                              ".nanoqwen file somewhere else")
    if out_path.is_dir():
        raise CheckpointError(f"{out_path} is a directory; give the path of the .nanoqwen file to write")
    # Both: `missing/../m.nanoqwen` resolves to an existing directory, but the OS cannot walk through `missing`.
    if not where.parent.is_dir() or not out_path.parent.is_dir():
        raise CheckpointError(f"cannot write {out_path}: the directory {out_path.parent} does not exist")
    if out_path.exists() and not out_path.is_file():  # the rename would put a file where /dev/null or a FIFO was
        raise CheckpointError(f"{out_path} is not a regular file; give the path of the .nanoqwen file to write")
    if os.path.lexists(out_path) and not overwrite:
        raise CheckpointError(f"{out_path} exists; pass --force to replace it")


def check_not_an_input(out_path: Path, inputs: set[Path]) -> None:
    """Even with --force, never replace a file the conversion reads (a shard may be a symlink into
    the Hugging Face cache, so the same file can have a name outside HF_DIR)."""
    if not out_path.exists():
        return
    for path in inputs:
        if path.exists() and os.path.samefile(out_path, path):
            raise CheckpointError(f"{out_path} is {path}, an input of this conversion; write the "
                                  ".nanoqwen file somewhere else")


def note_leftover_temp_files(out_path: Path) -> None:
    for path, pid in leftover_temp_files(out_path):
        try:
            size = _size(path.stat().st_size)
        except FileNotFoundError:  # removed since the directory was listed (its writer finished or failed)
            continue
        except OSError as err:  # a directory we may list but not look into: named, without a size
            size = f"size unknown: {err.strerror or err}"
        print(f"note: {path} ({size}) was left by an earlier convert (process {pid}, "
              f"{_writer_state(pid)}); it is not this run's and stays where it is", file=sys.stderr)


def _writer_state(pid: int) -> str:
    """Whether the process of a temp file's name runs. A pid of 0 or less, or one beyond what os.kill
    takes, was never a writer's: os.kill(0, 0) asks about our own process group, and a pid of more
    digits than a C long raises OverflowError."""
    if pid <= 0:
        return "which is no longer running"
    try:
        os.kill(pid, 0)
    except (OverflowError, ValueError, ProcessLookupError):
        return "which is no longer running"
    except OSError:  # PermissionError: the process exists but is someone else's
        return "which is still running"
    return "which is still running: another convert may be writing it"


def index_checkpoint(hf_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the checkpoint (single file or shards + index), from the headers alone."""
    index_path = hf_dir / "model.safetensors.index.json"
    if not index_path.exists():
        single = hf_dir / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")
        return read_safetensors_header(single)

    weight_map = read_json_object(index_path, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} is not a valid index (a JSON object with a weight_map object)")
    for shard in weight_map.values():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index_path} names shard {shard!r}, not a file name in {hf_dir}")
    sources: dict[str, SourceTensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = hf_dir / shard
        if not os.path.exists(shard_path):  # Path.exists raises on a name too long for the file system
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
        if not stat.S_ISREG(os.stat(path).st_mode):  # opening a FIFO would wait for a writer forever
            raise CheckpointError(f"{path} is not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path} is not a safetensors file (truncated or corrupt header)")
            header = json.loads(f.read(header_len).decode("utf-8"))
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError):  # ValueError: not JSON, not UTF-8, or an integer of over 4300 digits
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
            if not isinstance(dtype, str) or not all(isinstance(d, int) and d >= 0 for d in shape + (begin, end)):
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
    # Every layer has tensors of its own: bound the layer count before listing ~12 names per layer.
    if cfg.num_layers > len(sources):
        raise CheckpointError(f"config.json says num_hidden_layers={cfg.num_layers}, but the checkpoint holds "
                              f"only {len(sources)} tensors")
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


@contextlib.contextmanager
def _signals_unwind(signals):
    """While the block runs, each of `signals` raises SystemExit(128 + signal) in the main thread,
    so every `with` unwinds as for Ctrl-C (the writer removes its temp file) and the process exits
    with the code a shell expects of a killed one. Outside the main thread, signals are left alone
    (only the main thread may set handlers, and only it receives them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, unwind) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
