"""Writing a .nanoqwen file (docs/FORMAT.md): `NanoQwenWriter` streams tensors into a sibling temp
file and renames it into place only when the file is complete, so a reader never sees half a file
and an interrupted writer leaves its own temp file to be named (`leftover_temp_files`), never
deleted by anyone else. The layout and the reader are fileformat.py's.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import zlib
from pathlib import Path

import numpy as np

from .config import GROUP_SIZE, ModelConfig
from .errors import FormatError
from .fileformat import (ALIGNMENT, CONFIG_FLAG_FIELDS, CONFIG_FLOAT_FIELDS, CONFIG_INT_FIELDS, DTYPE_CODES, ENTRY,
                         ENTRY_SIZE, EXTRA_EOS_IDS, HEADER_SIZE, MAGIC, MAX_EXTRA_EOS, MAX_NDIM,
                         QUANT_INT4_VALUESHUFFLE, TOKENIZER_PRELUDE, VERSION, Header, align_up, pack_header)
from .tensors import stored_tensors


def temp_path(path: Path) -> Path:
    """Where NanoQwenWriter writes `path` until it is complete: a sibling no other writer uses."""
    return path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def leftover_temp_files(path) -> list[tuple[Path, int]]:
    """(temp file, pid of its writer) of each file next to `path` named as temp_path names them:
    writers that were killed outright (SIGKILL, a crash), or that are still writing."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.tmp\.(\d+)\.[0-9a-f]{8}")
    try:
        siblings = sorted(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:  # an unreadable directory: the writer reports it when it tries to write there
        return []
    return [(p, int(m[1])) for p in siblings if (m := pattern.fullmatch(p.name))]


def pack_tokenizer_blob(tokenizer_json: bytes, chat_template: str | None) -> bytes:
    template = b"" if chat_template is None else chat_template.encode("utf-8")
    prelude = TOKENIZER_PRELUDE.pack(len(tokenizer_json), len(template), chat_template is not None, bytes(7))
    return prelude + tokenizer_json + template


class NanoQwenWriter:
    """Writes one .nanoqwen file; use it as a context manager.

    Tensors are written to `<path>.tmp.<pid>.<random>` as soon as they are added (a 20 GB model
    never sits in memory twice). Header and table stay zero until the clean exit of the `with`
    block, which checks that every tensor was added, writes them, fsyncs and renames the temp file
    to `path`. Any failure removes the temp file and leaves `path` as it was.
    """

    def __init__(self, path, config: ModelConfig, *, lm_head_int4: bool, tokenizer_json: bytes,
                 chat_template: str | None, extra_eos_ids: tuple[int, ...] = ()):
        self.path = Path(path)
        self._tmp = temp_path(self.path)
        self._file = None
        header = _header_from_config(config, bool(lm_head_int4), tuple(extra_eos_ids))
        self._expected = stored_tensors(config.validate(), bool(lm_head_int4))
        self._entries: dict[str, bytes] = {}  # name -> packed table entry, in the order added
        blob = pack_tokenizer_blob(_checked_utf8(self.path, tokenizer_json, chat_template), chat_template)
        table_bytes = len(self._expected) * ENTRY_SIZE
        self._header = header._replace(
            table_offset=HEADER_SIZE, table_count=len(self._expected),
            tokenizer_offset=HEADER_SIZE + table_bytes, tokenizer_length=len(blob),
            tokenizer_crc32=zlib.crc32(blob))
        try:
            self._file = open(self._tmp, "xb")
            # Header and table are zeros until __exit__: an unfinished file never carries the magic.
            self._file.write(bytes(HEADER_SIZE + table_bytes))
            self._file.write(blob)
        except OSError as err:
            self._abort()
            raise FormatError(f"cannot write {self._tmp}: {err.strerror or err}") from None

    def __enter__(self) -> "NanoQwenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._abort()
            return False
        try:
            self._finish()
        except BaseException:
            self._abort()
            raise
        return False

    def add_tensor(self, name: str, array: np.ndarray) -> None:
        """Append `array` as tensor `name`, 4096-aligned; dtype and shape must match the config."""
        if self._file is None:
            raise FormatError(f"{self.path}: the writer is closed")
        if name not in self._expected:
            raise FormatError(f"{self.path}: {name!r} is not a tensor of this model "
                              "(see tensors.stored_tensors)")
        if name in self._entries:
            raise FormatError(f"{self.path}: tensor {name!r} was added twice")
        dtype, shape = self._expected[name]
        if not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype).newbyteorder("<"):
            got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise FormatError(f"{self.path}: tensor {name!r} has dtype {got}, expected little-endian {dtype}")
        if array.shape != shape:
            raise FormatError(f"{self.path}: tensor {name!r} has shape {array.shape}, expected {shape}")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        try:
            offset = align_up(self._file.tell())
            self._file.write(bytes(offset - self._file.tell()))
            self._file.write(data)
        except OSError as err:
            self._abort()
            raise FormatError(f"cannot write {self._tmp}: {err.strerror or err}") from None
        dims = list(shape) + [0] * (MAX_NDIM - len(shape))
        encoded = name.encode("utf-8")
        self._entries[name] = ENTRY.pack(offset, data.nbytes, zlib.crc32(data), DTYPE_CODES[dtype],
                                         len(shape), len(encoded), *dims, encoded)

    def _finish(self) -> None:
        if self._file is None:
            raise FormatError(f"{self.path}: the writer is closed")
        missing = [name for name in self._expected if name not in self._entries]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise FormatError(f"{self.path}: {len(missing)} tensors were never added: "
                              f"{', '.join(missing[:5])}{more}")
        table = b"".join(self._entries.values())
        try:
            file_size = self._file.tell()
            header = pack_header(self._header._replace(file_size=file_size), table)
            self._file.seek(HEADER_SIZE)
            self._file.write(table)
            self._file.seek(0)
            self._file.write(header)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
            _fsync_directory(self.path.parent)
        except OSError as err:
            raise FormatError(f"cannot write {self.path}: {err.strerror or err}") from None

    def _abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


def _checked_utf8(path: Path, tokenizer_json: bytes, chat_template: str | None) -> bytes:
    if not isinstance(tokenizer_json, bytes):
        raise FormatError(f"{path}: tokenizer_json must be bytes, got {type(tokenizer_json).__name__}")
    if not isinstance(chat_template, (str, type(None))):
        raise FormatError(f"{path}: chat_template must be a str or None, got {type(chat_template).__name__}")
    try:
        tokenizer_json.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise FormatError(f"{path}: tokenizer_json is not valid UTF-8 ({bad.reason} at byte {bad.start})") from None
    return tokenizer_json


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable: a crash after this cannot bring back the old file."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _header_from_config(config: ModelConfig, lm_head_int4: bool, extra_eos_ids: tuple[int, ...]) -> Header:
    """The header fields a config fills in; layout fields (offsets, sizes, checksums) are zero."""
    for name in CONFIG_INT_FIELDS:
        value = getattr(config, name)
        if not (isinstance(value, int) and 0 <= value < 2**32):
            raise FormatError(f"config {name}={value!r} does not fit the header's uint32 field")
    for name in CONFIG_FLOAT_FIELDS:
        if not math.isfinite(getattr(config, name)):
            raise FormatError(f"config {name}={getattr(config, name)!r} is not a finite number")
    if len(extra_eos_ids) > MAX_EXTRA_EOS:
        raise FormatError(f"{len(extra_eos_ids)} end-of-generation ids besides eos_token_id; the header "
                          f"holds at most {MAX_EXTRA_EOS}")
    for index, token in enumerate(extra_eos_ids):
        if not (isinstance(token, int) and 0 <= token < config.vocab_size) or token == config.eos_token_id \
                or token in extra_eos_ids[:index]:
            raise FormatError(f"extra end-of-generation id {token!r} must be a token id below vocab_size "
                              f"{config.vocab_size}, other than eos_token_id and given once")
    fields = dict.fromkeys(Header._fields, 0)
    fields.update({name: getattr(config, name) for name in CONFIG_INT_FIELDS + CONFIG_FLOAT_FIELDS})
    fields.update({name: int(bool(getattr(config, name))) for name in CONFIG_FLAG_FIELDS})
    fields.update(magic=MAGIC, version=VERSION, header_size=HEADER_SIZE, lm_head_int4=int(lm_head_int4),
                  quant_scheme=QUANT_INT4_VALUESHUFFLE, group_size=GROUP_SIZE, alignment=ALIGNMENT,
                  table_entry_size=ENTRY_SIZE, reserved=bytes(84), extra_eos_count=len(extra_eos_ids),
                  extra_eos_ids=EXTRA_EOS_IDS.pack(*extra_eos_ids, *[0] * (MAX_EXTRA_EOS - len(extra_eos_ids))))
    return Header(**fields)
