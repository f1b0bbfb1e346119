"""The .nanoqwen file: a 256-byte header, a tensor table, a tokenizer blob and page-aligned tensors.

filewriter.NanoQwenWriter writes a file; `NanoQwenFile` mmaps a file and validates every byte of it before handing out
zero-copy tensor views; `describe` is `python -m pynanoqwen info`. docs/FORMAT.md is the spec and
draws every layout below. The converter (convert.py) writes files; the numpy reference model and
the GPU engine read them. Which tensors a file holds is decided by tensors.stored_tensors alone.

Every byte of a valid file is covered by a check: header and table by the header's CRC-32, the
tokenizer blob by its CRC-32, each tensor by its own, and the padding between them must be zero.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import stat
import struct
import zlib
from collections import namedtuple
from pathlib import Path

import numpy as np

from .config import GROUP_SIZE, ModelConfig
from .errors import ConfigError, FormatError
from .tensors import QWEIGHT, SCALES, stored_tensors

MAGIC = b"NANOQWEN"
VERSION = 1
HEADER_SIZE = 256
ALIGNMENT = 4096  # each tensor starts on a page: mmap-able, and one host-to-GPU copy per tensor
QUANT_INT4_VALUESHUFFLE = 1  # symmetric INT4, one FP16 scale per GROUP_SIZE inputs, quant.py layout
DTYPES = {1: "float16", 2: "uint32"}  # table dtype code -> numpy dtype name (always little-endian)
DTYPE_CODES = {name: code for code, name in DTYPES.items()}
MAX_NDIM = 4

# (field, struct code) in file order; docs/FORMAT.md has the same table with byte offsets.
HEADER_FIELDS = (
    ("magic", "8s"), ("version", "I"), ("header_size", "I"), ("file_size", "Q"),
    ("hidden_size", "I"), ("intermediate_size", "I"), ("num_layers", "I"), ("num_heads", "I"),
    ("num_kv_heads", "I"), ("head_dim", "I"), ("vocab_size", "I"), ("max_position_embeddings", "I"),
    ("rope_theta", "d"), ("rms_norm_eps", "d"), ("bos_token_id", "I"), ("eos_token_id", "I"),
    ("tie_word_embeddings", "B"), ("qkv_bias", "B"), ("lm_head_int4", "B"), ("quant_scheme", "B"),
    ("group_size", "I"), ("alignment", "I"), ("table_entry_size", "I"),
    ("table_offset", "Q"), ("table_count", "Q"), ("tokenizer_offset", "Q"), ("tokenizer_length", "Q"),
    ("tokenizer_crc32", "I"), ("reserved", "84s"), ("extra_eos_count", "I"), ("extra_eos_ids", "32s"),
    ("header_crc32", "I"),
)
HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
Header = namedtuple("Header", [name for name, _ in HEADER_FIELDS])
HEADER_CRC_OFFSET = HEADER_SIZE - 4  # the checksum is the header's last field
# End-of-generation ids besides eos_token_id (bytes 216..251, reserved before they were added): a
# count and 8 uint32 slots, unused slots zero. A file without any is what earlier writers wrote.
MAX_EXTRA_EOS = 8
EXTRA_EOS_IDS = struct.Struct(f"<{MAX_EXTRA_EOS}I")

ENTRY_FIELDS = (
    ("offset", "Q"), ("nbytes", "Q"), ("crc32", "I"), ("dtype", "B"), ("ndim", "B"),
    ("name_length", "H"), ("dim0", "I"), ("dim1", "I"), ("dim2", "I"), ("dim3", "I"), ("name", "88s"),
)
ENTRY = struct.Struct("<" + "".join(code for _, code in ENTRY_FIELDS))
Entry = namedtuple("Entry", [name for name, _ in ENTRY_FIELDS])
ENTRY_SIZE = 128
MAX_NAME_BYTES = 88

# Tokenizer blob: json_length u64, template_length u64, has_template u8, 7 zero bytes, then the
# tokenizer.json bytes and the chat template's UTF-8 bytes, back to back.
TOKENIZER_PRELUDE = struct.Struct("<QQB7s")

CONFIG_INT_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id")
CONFIG_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
CONFIG_FLAG_FIELDS = ("tie_word_embeddings", "qkv_bias")

assert HEADER.size == HEADER_SIZE and ENTRY.size == ENTRY_SIZE and TOKENIZER_PRELUDE.size == 24
assert EXTRA_EOS_IDS.size == 32


def align_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def header_crc32(header: bytes, table: bytes) -> int:
    """CRC-32 (zlib) of header bytes 0..251 followed by the whole tensor table."""
    return zlib.crc32(table, zlib.crc32(header[:HEADER_CRC_OFFSET]))


def pack_header(header: Header, table: bytes) -> bytes:
    """The 256 header bytes for `header`, with header_crc32 computed over them and `table`."""
    unsigned = HEADER.pack(*header._replace(header_crc32=0))
    return HEADER.pack(*header._replace(header_crc32=header_crc32(unsigned, table)))


@dataclasses.dataclass(frozen=True)
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


class NanoQwenFile:
    """A validated, read-only, mmapped .nanoqwen file; use it as a context manager.

    The constructor checks everything (docs/FORMAT.md, "What a reader checks") and raises
    FormatError naming what is wrong and where; after it returns, every offset is known to be in
    bounds. verify_data=True also checks each tensor's CRC-32, which reads the whole file once
    (zlib.crc32 runs at a few GB/s; the disk is usually the limit).

    Attributes: path, header (the raw Header fields), version, config (ModelConfig), lm_head_int4,
    extra_eos_ids (end-of-generation ids besides config.eos_token_id), tokenizer_json (bytes),
    chat_template (str or None), names (tensor names in table order).
    """

    def __init__(self, path, *, verify_data: bool = True):
        self.path = model_path(path)
        self._mmap = None
        self._bytes = None  # the whole file as a read-only uint8 array; tensors are views of it
        self._tensors: dict[str, _Tensor] = {}
        try:
            self._mmap = _map_read_only(self.path)
            self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
            self._validate(verify_data)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "NanoQwenFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy, read-only view of tensor `name` in the mmap, with its dtype and shape."""
        t = self._lookup(name)
        return self._bytes[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)

    def nbytes(self, name: str) -> int:
        return self._lookup(name).nbytes

    def offset(self, name: str) -> int:
        """Byte offset of tensor `name` in the file (a multiple of 4096)."""
        return self._lookup(name).offset

    def close(self) -> None:
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # tensor views are still alive; the mapping is unmapped when the last one dies
            self._mmap = None

    def _lookup(self, name: str) -> _Tensor:
        if self._bytes is None:
            raise ValueError(f"{self.path} is closed")
        try:
            return self._tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor named {name!r}") from None

    def _fail(self, where: str, what: str) -> FormatError:
        return FormatError(f"{self.path}: {where}: {what}")

    def _validate(self, verify_data: bool) -> None:
        size = len(self._mmap)
        h = Header._make(HEADER.unpack_from(self._mmap, 0))
        if h.magic != MAGIC:
            raise FormatError(f"{self.path}: not a .nanoqwen file (starts with {h.magic!r}, "
                              f"expected {MAGIC!r})")
        if h.version != VERSION:
            raise self._fail("header", f"format version {h.version} is not supported "
                                       f"(this reader reads version {VERSION})")
        if h.header_size != HEADER_SIZE:
            raise self._fail("header", f"header_size is {h.header_size}, version 1 headers are "
                                       f"{HEADER_SIZE} bytes")
        if h.file_size != size:
            raise self._fail("header", f"file_size says {h.file_size} bytes but the file has {size} "
                                       "(truncated or appended to)")
        if h.table_entry_size != ENTRY_SIZE:
            raise self._fail("header", f"table_entry_size is {h.table_entry_size}, version 1 entries "
                                       f"are {ENTRY_SIZE} bytes")
        # Bound the table by the file size before touching it: a forged count allocates nothing.
        table_end = h.table_offset + h.table_count * ENTRY_SIZE
        if h.table_count == 0 or h.table_offset < HEADER_SIZE or table_end > size:
            raise self._fail("header", f"tensor table ({h.table_count} entries at offset "
                                       f"{h.table_offset}) does not fit in the {size}-byte file")
        computed = header_crc32(self._mmap[:HEADER_SIZE], self._mmap[h.table_offset:table_end])
        if computed != h.header_crc32:
            raise self._fail("header", f"checksum mismatch (stored {h.header_crc32:#010x}, computed "
                                       f"{computed:#010x}): the header or tensor table is corrupt")
        self.header = h
        self.version = h.version
        self.config, self.lm_head_int4 = self._config_from_header(h)
        self.extra_eos_ids = self._extra_eos_ids(h)
        expected = stored_tensors(self.config, self.lm_head_int4)
        if h.table_count != len(expected):
            raise self._fail("header", f"tensor table has {h.table_count} entries but this config "
                                       f"stores {len(expected)} tensors")
        regions = [(0, HEADER_SIZE, "header"), (h.table_offset, table_end, "tensor table")]
        if h.tokenizer_length < TOKENIZER_PRELUDE.size or h.tokenizer_offset + h.tokenizer_length > size:
            raise self._fail("header", f"tokenizer blob ({h.tokenizer_length} bytes at offset "
                                       f"{h.tokenizer_offset}) does not fit in the {size}-byte file")
        regions.append((h.tokenizer_offset, h.tokenizer_offset + h.tokenizer_length, "tokenizer blob"))
        for index in range(h.table_count):
            name, tensor = self._read_entry(index, h.table_offset + index * ENTRY_SIZE, expected, size)
            self._tensors[name] = tensor
            regions.append((tensor.offset, tensor.offset + tensor.nbytes, f"tensor {name!r}"))
        self.names = list(self._tensors)
        self._check_layout(regions, size)
        self._read_tokenizer_blob(h)
        if verify_data:
            for name, t in self._tensors.items():
                computed = zlib.crc32(self._bytes[t.offset:t.offset + t.nbytes])
                if computed != t.crc32:
                    raise self._fail(f"tensor {name!r}", f"data checksum mismatch (stored {t.crc32:#010x}, "
                                                         f"computed {computed:#010x}): the data is corrupt")

    def _config_from_header(self, h: Header) -> tuple[ModelConfig, bool]:
        if h.reserved != bytes(len(h.reserved)):
            raise self._fail("header", "reserved bytes 132..215 are not zero")
        for name in CONFIG_FLAG_FIELDS + ("lm_head_int4",):
            if getattr(h, name) not in (0, 1):
                raise self._fail("header", f"{name} is {getattr(h, name)}, expected 0 or 1")
        if h.quant_scheme != QUANT_INT4_VALUESHUFFLE:
            raise self._fail("header", f"quant_scheme {h.quant_scheme} is unknown "
                                       f"(1 = INT4 ValueShuffle is the only one)")
        if h.group_size != GROUP_SIZE:
            raise self._fail("header", f"group_size is {h.group_size}, this reader handles {GROUP_SIZE}")
        if h.alignment != ALIGNMENT:
            raise self._fail("header", f"alignment is {h.alignment}, version 1 files use {ALIGNMENT}")
        for name in CONFIG_FLOAT_FIELDS:
            if not math.isfinite(getattr(h, name)):
                raise self._fail("header", f"{name} is {getattr(h, name)}, not a finite number")
        # stored_tensors builds ~19 names per layer: bound the layer count by the (already
        # file-bounded) table before asking for them.
        if h.num_layers > h.table_count:
            raise self._fail("header", f"num_layers {h.num_layers} needs more tensors than the "
                                       f"table's {h.table_count}")
        fields = {name: getattr(h, name) for name in CONFIG_INT_FIELDS + CONFIG_FLOAT_FIELDS}
        fields.update({name: bool(getattr(h, name)) for name in CONFIG_FLAG_FIELDS})
        try:
            config = ModelConfig(**fields).validate()
        except ConfigError as bad:
            raise self._fail("header", f"invalid model config: {bad}") from None
        return config, bool(h.lm_head_int4)

    def _extra_eos_ids(self, h: Header) -> tuple[int, ...]:
        slots = EXTRA_EOS_IDS.unpack(h.extra_eos_ids)
        if h.extra_eos_count > MAX_EXTRA_EOS or any(slots[h.extra_eos_count:]):
            raise self._fail("header", f"extra_eos_count is {h.extra_eos_count} (at most {MAX_EXTRA_EOS}, "
                                       "unused extra_eos_ids slots zero)")
        ids = slots[:h.extra_eos_count]
        for token in ids:
            if token >= self.config.vocab_size:
                raise self._fail("header", f"extra end-of-generation id {token} is not a token id of the "
                                           f"{self.config.vocab_size}-token vocabulary")
        return ids

    def _read_entry(self, index: int, at: int, expected: dict, size: int) -> tuple[str, _Tensor]:
        e = Entry._make(ENTRY.unpack_from(self._mmap, at))
        where = f"table entry {index} (byte {at})"
        if not 0 < e.name_length <= MAX_NAME_BYTES or any(e.name[e.name_length:]):
            raise self._fail(where, f"name_length {e.name_length} is out of range 1..{MAX_NAME_BYTES} "
                                    "or the name is not zero-padded")
        try:
            name = e.name[:e.name_length].decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(where, f"name {e.name[:e.name_length]!r} is not valid UTF-8") from None
        where = f"table entry {index} ({name!r})"
        if name in self._tensors:
            raise self._fail(where, "the name appears twice in the table")
        if name not in expected:
            raise self._fail(where, "not a tensor of this model (see tensors.stored_tensors)")
        dtype, shape = expected[name]
        if DTYPES.get(e.dtype) != dtype:
            raise self._fail(where, f"dtype code {e.dtype} ({DTYPES.get(e.dtype, 'unknown')}), "
                                    f"expected {DTYPE_CODES[dtype]} ({dtype})")
        dims = (e.dim0, e.dim1, e.dim2, e.dim3)
        if e.ndim != len(shape) or dims[:e.ndim] != shape or any(dims[e.ndim:]):
            raise self._fail(where, f"shape {dims[:min(e.ndim, MAX_NDIM)]} with ndim {e.ndim} "
                                    f"(unused dims {dims[min(e.ndim, MAX_NDIM):]}), expected {shape}")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if e.nbytes != nbytes:
            raise self._fail(where, f"nbytes is {e.nbytes}, shape {shape} of {dtype} needs {nbytes}")
        if e.offset % ALIGNMENT:
            raise self._fail(where, f"offset {e.offset} is not a multiple of {ALIGNMENT}")
        if e.offset + e.nbytes > size:
            raise self._fail(where, f"data (bytes {e.offset}..{e.offset + e.nbytes}) runs past "
                                    f"the end of the {size}-byte file")
        return name, _Tensor(dtype, shape, e.offset, e.nbytes, e.crc32)

    def _check_layout(self, regions: list[tuple[int, int, str]], size: int) -> None:
        """No two regions overlap, and every byte between them (the padding) is zero."""
        regions = sorted(regions)
        for (_, prev_end, prev_label), (start, end, label) in zip(regions, regions[1:]):
            if start < prev_end:
                raise FormatError(f"{self.path}: {label} (bytes {start}..{end}) overlaps {prev_label} "
                                  f"(which ends at byte {prev_end})")
        # Checked after all overlaps: a tensor moved onto another leaves its old bytes as "padding".
        prev_end, prev_label = 0, "start of file"
        for start, end, label in regions + [(size, size, "end of file")]:
            if self._bytes[prev_end:start].any():
                raise FormatError(f"{self.path}: padding bytes {prev_end}..{start} between {prev_label} "
                                  f"and {label} are not zero")
            prev_end, prev_label = end, label

    def _read_tokenizer_blob(self, h: Header) -> None:
        where = f"tokenizer blob (offset {h.tokenizer_offset})"
        blob = self._mmap[h.tokenizer_offset:h.tokenizer_offset + h.tokenizer_length]
        if zlib.crc32(blob) != h.tokenizer_crc32:
            raise self._fail(where, f"checksum mismatch (stored {h.tokenizer_crc32:#010x}, "
                                    f"computed {zlib.crc32(blob):#010x}): the blob is corrupt")
        json_length, template_length, has_template, pad = TOKENIZER_PRELUDE.unpack_from(blob, 0)
        if TOKENIZER_PRELUDE.size + json_length + template_length != len(blob):
            raise self._fail(where, f"json_length {json_length} + template_length {template_length} "
                                    f"+ {TOKENIZER_PRELUDE.size} != blob length {len(blob)}")
        if has_template not in (0, 1) or any(pad) or (template_length and not has_template):
            raise self._fail(where, "malformed prelude (has_template must be 0 or 1, padding zero, "
                                    "no template bytes without has_template)")
        json_end = TOKENIZER_PRELUDE.size + json_length
        try:
            blob[TOKENIZER_PRELUDE.size:json_end].decode("utf-8")
            template = blob[json_end:].decode("utf-8") if has_template else None
        except UnicodeDecodeError as bad:
            raise self._fail(where, f"text is not valid UTF-8 ({bad.reason})") from None
        self.tokenizer_json = blob[TOKENIZER_PRELUDE.size:json_end]
        self.chat_template = template


def model_path(path) -> Path:
    """`path` (a str or Path) as a Path, refused when empty: Path("") is ".", a directory."""
    if not str(path).strip():
        raise FormatError("the model path is empty; give the path of a .nanoqwen file")
    return Path(path)


def _map_read_only(path: Path) -> mmap.mmap:
    """mmap the whole file read-only; every OS-level failure becomes a FormatError."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise FormatError(f"{path}: is {kind}, expected a .nanoqwen file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:
                raise FormatError(f"{path}: {size} bytes, too short for the {HEADER_SIZE}-byte header")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except (OSError, ValueError) as err:  # ValueError: mmap of a file that shrank to 0 meanwhile
        raise FormatError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None


def describe(path) -> str:
    """`python -m pynanoqwen info`: header, config, tokenizer, tensor summary, example tensors."""
    from .tokenizer import Tokenizer  # tokenizers and jinja2: only for describing a whole file

    with NanoQwenFile(path, verify_data=True) as f:
        h = f.header
        tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, None, vocab_size=f.config.vocab_size)
        size = h.file_size
        lines = [
            f"file              {f.path}",
            f"size              {size:,} bytes ({size / 2**30:.3f} GiB)",
            f"format            NANOQWEN version {h.version}, {h.header_size}-byte header, "
            f"tensors aligned to {h.alignment} bytes",
            f"checksums         CRC-32 (zlib) of header+table, tokenizer blob and all "
            f"{len(f.names)} tensors: all verified",
            f"tensor table      {h.table_count} entries x {h.table_entry_size} bytes at offset {h.table_offset}",
            f"tokenizer blob    {h.tokenizer_length:,} bytes at offset {h.tokenizer_offset}: "
            f"tokenizer.json {len(f.tokenizer_json):,} bytes ({tokenizer.size:,} tokens of the "
            f"{f.config.vocab_size:,}-id vocabulary), chat template "
            + ("none" if f.chat_template is None else f"{len(f.chat_template.encode('utf-8')):,} bytes"),
            f"quantization      INT4 symmetric (scheme {h.quant_scheme}), one FP16 scale per "
            f"{h.group_size} inputs, ValueShuffle nibble order; lm_head "
            + ("INT4" if f.lm_head_int4 else "FP16"),
            f"end of generation eos_token_id {f.config.eos_token_id}; extra ids "
            + (", ".join(map(str, f.extra_eos_ids)) or "none"),
            "config",
        ]
        lines += [f"  {field.name:<25} {getattr(f.config, field.name)}" for field in dataclasses.fields(f.config)]
        by_dtype: dict[str, list[int]] = {}
        for name in f.names:
            count_bytes = by_dtype.setdefault(f._tensors[name].dtype, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += f.nbytes(name)
        qweights = [n for n in f.names if n.endswith(QWEIGHT)]
        int4_bytes = sum(f.nbytes(n) + f.nbytes(n[:-len(QWEIGHT)] + SCALES) for n in qweights)
        int4_weights = sum(f.nbytes(n) * 2 for n in qweights)  # two 4-bit weights per byte
        fp16 = [n for n in f.names if not n.endswith((QWEIGHT, SCALES))]
        data_bytes = sum(f.nbytes(n) for n in f.names)
        lines.append(f"tensors           {len(f.names)}, {data_bytes:,} bytes of data "
                     f"({size - data_bytes:,} bytes of header, table, tokenizer and padding)")
        lines += [f"  {dtype:<25} {count:>5} tensors {nbytes:>16,} bytes"
                  for dtype, (count, nbytes) in sorted(by_dtype.items())]
        lines.append(f"  {'INT4 (qweight+scales)':<25} {len(qweights):>5} linears {int4_bytes:>16,} bytes"
                     + (f" ({8 * int4_bytes / int4_weights:.3f} bits/weight)" if qweights else ""))
        lines.append(f"  {'FP16 (emb/norm/bias)':<25} {len(fp16):>5} tensors "
                     f"{sum(f.nbytes(n) for n in fp16):>16,} bytes")
        lines.append("examples")
        for name in _example_names(f.names):
            t = f._tensors[name]
            lines.append(f"  {name:<48} {t.dtype:<8} {str(list(t.shape)):<14} offset {t.offset:>14,} "
                         f"bytes {t.nbytes:>14,} crc32 {t.crc32:#010x}")
    return "\n".join(lines)


def _example_names(names: list[str]) -> list[str]:
    wanted = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.weight" + QWEIGHT,
              "model.layers.0.self_attn.q_proj.weight" + SCALES, "model.norm.weight",
              "lm_head.weight", "lm_head.weight" + QWEIGHT]
    return [name for name in wanted if name in names]
