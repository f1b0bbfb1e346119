"""The .nanoqwen format: bit-exact round trips, a writer that refuses bad input and never leaves a
half-written file, and a reader that turns any corruption into FormatError.

The fuzz tests (hypothesis) corrupt a small valid file in four ways: truncation/extension, single
bit flips, random byte overwrites, and forged field values with every checksum recomputed so the
checks behind the checksums run too. Any exception other than FormatError fails them. Run with
`-s` to see how many cases each one executed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import struct
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pynanoqwen.cli import main as cli
from pynanoqwen.config import PRESETS, ModelConfig
from pynanoqwen.errors import ConfigError, FormatError
from pynanoqwen.fileformat import (
    ENTRY,
    ENTRY_FIELDS,
    ENTRY_SIZE,
    HEADER,
    HEADER_FIELDS,
    TOKENIZER_PRELUDE,
    Entry,
    Header,
    NanoQwenFile,
    describe,
    pack_header,
)
from pynanoqwen.filewriter import NanoQwenWriter
from pynanoqwen.tensors import stored_tensors

TINY = PRESETS["tiny"]
TINY_TIED = dataclasses.replace(TINY, tie_word_embeddings=True)
# The smallest config the INT4 group size allows, so a fuzz case writes and reads 213,504 bytes.
SMALL = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=64, vocab_size=256, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# Non-ASCII on purpose: the blob must carry UTF-8 byte-exactly.
TOKENIZER_JSON = '{"version": "1.0", "model": {"type": "BPE", "vocab": {"Ġé": 0, "→": 1}, "merges": []}}'.encode()
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}·"

FUZZ_CASES: Counter[str] = Counter()  # cases executed per fuzz test, printed with -s


def random_tensors(cfg: ModelConfig, lm_head_int4: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random bits for every stored tensor (float16 includes NaN/inf patterns: storage must be bit-exact)."""
    out = {}
    for name, (dtype, shape) in stored_tensors(cfg, lm_head_int4).items():
        if dtype == "uint32":
            out[name] = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        else:
            out[name] = rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(np.float16)
    return out


def write_file(path: Path, cfg: ModelConfig, lm_head_int4: bool, tensors: dict[str, np.ndarray],
               order: list[str] | None = None, chat_template: str | None = CHAT_TEMPLATE) -> None:
    with NanoQwenWriter(path, cfg, lm_head_int4=lm_head_int4, tokenizer_json=TOKENIZER_JSON,
                        chat_template=chat_template) as writer:
        for name in order or list(tensors):
            writer.add_tensor(name, tensors[name])


# ------------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["tiny", "tiny-tied"])
@pytest.mark.parametrize("lm_head_int4", [True, False], ids=["lm_head-int4", "lm_head-fp16"])
def test_round_trip_is_bit_exact(tmp_path, cfg, lm_head_int4):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    tensors = random_tensors(cfg, lm_head_int4, rng)
    order = list(rng.permutation(list(tensors)))  # the writer accepts any order; the table keeps it
    path = tmp_path / "m.nanoqwen"
    write_file(path, cfg, lm_head_int4, tensors, order)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nanoqwen"]  # no temp file left behind
    with NanoQwenFile(path) as f:
        assert f.config == cfg and f.lm_head_int4 is lm_head_int4 and f.version == 1
        assert f.tokenizer_json == TOKENIZER_JSON and f.chat_template == CHAT_TEMPLATE
        assert f.names == order
        assert ("lm_head.weight.qweight" in f.names) == lm_head_int4
        assert ("lm_head.weight" in f.names) == (not lm_head_int4 and not cfg.tie_word_embeddings)
        for name, expected in tensors.items():
            got = f.tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert got.tobytes() == expected.tobytes(), f"{name} differs (seed {seed})"
            assert not got.flags.writeable
            assert f.offset(name) % 4096 == 0 and got.ctypes.data % 4096 == 0
            assert f.nbytes(name) == expected.nbytes
        with pytest.raises(FormatError, match="no tensor named 'model.bogus'"):
            f.tensor("model.bogus")


@pytest.mark.parametrize("template", [None, ""], ids=["no-template", "empty-template"])
def test_chat_template_none_and_empty_are_distinct(tmp_path, template):
    path = tmp_path / "m.nanoqwen"
    write_file(path, SMALL, True, random_tensors(SMALL, True, np.random.default_rng()), chat_template=template)
    with NanoQwenFile(path, verify_data=False) as f:
        assert f.chat_template == template


def test_header_layout_matches_spec(tmp_path):
    """Read a written file with literal offsets from docs/FORMAT.md, independent of the module's structs."""
    path = tmp_path / "m.nanoqwen"
    tensors = random_tensors(TINY, True, np.random.default_rng())
    write_file(path, TINY, True, tensors)
    data = path.read_bytes()
    u32 = lambda at: struct.unpack_from("<I", data, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", data, at)[0]  # noqa: E731
    assert data[:8] == b"NANOQWEN" and u32(8) == 1 and u32(12) == 256 and u64(16) == len(data)
    assert [u32(at) for at in range(24, 56, 4)] == [256, 640, 2, 4, 2, 64, 2048, 2048]
    assert struct.unpack_from("<dd", data, 56) == (TINY.rope_theta, TINY.rms_norm_eps)
    assert (u32(72), u32(76)) == (0, 2) and tuple(data[80:84]) == (0, 1, 1, 1)
    assert (u32(84), u32(88), u32(92)) == (128, 4096, 128)
    table_offset, count = u64(96), u64(104)
    tok_offset, tok_length = u64(112), u64(120)
    assert count == len(tensors) and data[132:252] == bytes(120)
    table = data[table_offset:table_offset + 128 * count]
    assert u32(252) == zlib.crc32(data[:252] + table)
    assert u32(128) == zlib.crc32(data[tok_offset:tok_offset + tok_length])
    json_len, template_len = struct.unpack_from("<QQ", data, tok_offset)
    assert data[tok_offset + 16] == 1 and data[tok_offset + 17:tok_offset + 24] == bytes(7)
    assert data[tok_offset + 24:tok_offset + 24 + json_len] == TOKENIZER_JSON
    assert data[tok_offset + 24 + json_len:tok_offset + 24 + json_len + template_len] == CHAT_TEMPLATE.encode()
    for i in range(count):
        entry = table[128 * i:128 * (i + 1)]
        offset, nbytes, crc, dtype, ndim, name_len = struct.unpack_from("<QQIBBH", entry, 0)
        dims = struct.unpack_from("<4I", entry, 24)
        name = entry[40:40 + name_len].decode()
        want = tensors[name]
        assert (dtype, ndim, dims[:ndim], nbytes) == ({"float16": 1, "uint32": 2}[want.dtype.name],
                                                      want.ndim, want.shape, want.nbytes)
        assert offset % 4096 == 0 and data[offset:offset + nbytes] == want.tobytes()
        assert crc == zlib.crc32(want.tobytes()) and entry[40 + name_len:] == bytes(88 - name_len)


# ------------------------------------------------------------------------------------ writer refusals

def _add_all_but(skip):
    def act(writer, tensors):
        for name, array in tensors.items():
            if name != skip:
                writer.add_tensor(name, array)
    return act


def _add_then(bad):
    def act(writer, tensors):
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        bad(writer, tensors)
    return act


NORM = "model.norm.weight"
QW = "model.layers.0.mlp.down_proj.weight.qweight"
REFUSALS = {
    "unknown-name": (lambda w, t: w.add_tensor("model.layers.0.mlp.bogus.weight", t[NORM]), "bogus"),
    "hf-name-of-int4-tensor": (lambda w, t: w.add_tensor("model.layers.0.mlp.up_proj.weight", t[NORM]),
                               "up_proj.weight' is not a tensor"),
    "float32": (lambda w, t: w.add_tensor(NORM, t[NORM].astype(np.float32)), "dtype float32"),
    "int32-qweight": (lambda w, t: w.add_tensor(QW, t[QW].view(np.int32)), "dtype int32"),
    "big-endian": (lambda w, t: w.add_tensor(NORM, t[NORM].astype(">f2")), "little-endian float16"),
    "not-an-array": (lambda w, t: w.add_tensor(NORM, t[NORM].tolist()), "dtype list"),
    "transposed": (lambda w, t: w.add_tensor(QW, np.ascontiguousarray(t[QW].T)), "shape"),
    "flattened": (lambda w, t: w.add_tensor(QW, t[QW].reshape(-1)), "shape"),
    "duplicate": (_add_then(lambda w, t: w.add_tensor(NORM, t[NORM])), "added twice"),
    "missing": (_add_all_but(QW), "1 tensors were never added: " + QW),
}


@pytest.mark.parametrize("existing", [False, True], ids=["no-target", "existing-target"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_writer_refuses_and_leaves_no_file(tmp_path, case, existing):
    act, message = REFUSALS[case]
    path = tmp_path / "m.nanoqwen"
    if existing:
        path.write_bytes(b"the previous file")
    tensors = random_tensors(SMALL, True, np.random.default_rng())
    with pytest.raises(FormatError, match=message):
        with NanoQwenWriter(path, SMALL, lm_head_int4=True, tokenizer_json=TOKENIZER_JSON,
                            chat_template=None) as writer:
            act(writer, tensors)
    assert [p.name for p in tmp_path.iterdir()] == (["m.nanoqwen"] if existing else [])
    if existing:
        assert path.read_bytes() == b"the previous file"


@pytest.mark.parametrize("existing", [False, True], ids=["no-target", "existing-target"])
def test_exception_inside_with_leaves_no_temp_file(tmp_path, existing):
    path = tmp_path / "m.nanoqwen"
    if existing:
        path.write_bytes(b"the previous file")
    tensors = random_tensors(SMALL, True, np.random.default_rng())
    with pytest.raises(RuntimeError, match="converter crashed"):
        with NanoQwenWriter(path, SMALL, lm_head_int4=True, tokenizer_json=TOKENIZER_JSON,
                            chat_template=None) as writer:
            for name, array in list(tensors.items())[:5]:
                writer.add_tensor(name, array)
            assert len(list(tmp_path.iterdir())) == 1 + existing  # the temp file exists meanwhile
            raise RuntimeError("converter crashed")
    assert [p.name for p in tmp_path.iterdir()] == (["m.nanoqwen"] if existing else [])
    if existing:
        assert path.read_bytes() == b"the previous file"


def test_writer_refuses_bad_tokenizer_bad_config_and_bad_directory(tmp_path):
    kwargs = dict(lm_head_int4=True, chat_template=None)
    with pytest.raises(FormatError, match="not valid UTF-8"):
        NanoQwenWriter(tmp_path / "m.nanoqwen", SMALL, tokenizer_json=b"\xff\xfe", **kwargs)
    with pytest.raises(ConfigError, match="group size"):
        NanoQwenWriter(tmp_path / "m.nanoqwen", dataclasses.replace(SMALL, intermediate_size=200),
                       tokenizer_json=b"{}", **kwargs)
    with pytest.raises(FormatError, match="does not fit the header's uint32"):
        NanoQwenWriter(tmp_path / "m.nanoqwen", dataclasses.replace(SMALL, eos_token_id=2**32),
                       tokenizer_json=b"{}", **kwargs)
    with pytest.raises(FormatError, match="cannot write"):
        NanoQwenWriter(tmp_path / "no-such-dir" / "m.nanoqwen", SMALL, tokenizer_json=b"{}", **kwargs)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ reader refusals

def test_reader_refuses_missing_empty_short_directory_and_foreign_files(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        NanoQwenFile(tmp_path / "absent.nanoqwen")
    with pytest.raises(FormatError, match="is a directory"):
        NanoQwenFile(tmp_path)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(FormatError, match="0 bytes, too short"):
        NanoQwenFile(tmp_path / "empty")
    (tmp_path / "short").write_bytes(b"NANOQWEN" + bytes(100))
    with pytest.raises(FormatError, match="108 bytes, too short"):
        NanoQwenFile(tmp_path / "short")
    (tmp_path / "foreign").write_bytes(np.random.default_rng().bytes(5000))
    with pytest.raises(FormatError, match="not a .nanoqwen file"):
        NanoQwenFile(tmp_path / "foreign")


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    """A valid file of the SMALL config (INT4 lm_head), as bytes."""
    path = tmp_path_factory.mktemp("small") / "small.nanoqwen"
    write_file(path, SMALL, True, random_tensors(SMALL, True, np.random.default_rng()))
    return path.read_bytes()


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


class Forge:
    """Edits fields of a valid file, then reseals it: recomputes the tokenizer and header CRCs from
    the edited fields, exactly as a writer would, so the reader's checks behind them must fire."""

    def __init__(self, data: bytes):
        self.buf = bytearray(data)

    @property
    def header(self) -> Header:
        return Header._make(HEADER.unpack_from(self.buf, 0))

    def set_header(self, **fields) -> "Forge":
        HEADER.pack_into(self.buf, 0, *self.header._replace(**fields))
        return self

    def entry_at(self, index: int) -> int:
        return self.header.table_offset + index * ENTRY_SIZE

    def entry(self, index: int) -> Entry:
        return Entry._make(ENTRY.unpack_from(self.buf, self.entry_at(index)))

    def set_entry(self, index: int, **fields) -> "Forge":
        ENTRY.pack_into(self.buf, self.entry_at(index), *self.entry(index)._replace(**fields))
        return self

    def set_prelude(self, **fields) -> "Forge":
        names = ("json_length", "template_length", "has_template", "pad")
        at = self.header.tokenizer_offset
        values = dict(zip(names, TOKENIZER_PRELUDE.unpack_from(self.buf, at)), **fields)
        TOKENIZER_PRELUDE.pack_into(self.buf, at, *values.values())
        return self

    def sealed(self) -> bytes:
        h = self.header
        blob = self.buf[h.tokenizer_offset:h.tokenizer_offset + h.tokenizer_length]
        h = h._replace(tokenizer_crc32=zlib.crc32(blob))
        table = bytes(self.buf[h.table_offset:h.table_offset + h.table_count * ENTRY_SIZE])
        self.buf[:HEADER.size] = pack_header(h, table)
        return bytes(self.buf)


def open_forged(directory: Path, data: bytes, counter: str) -> FormatError | None:
    """Open `data` as a file with full verification: the FormatError, or None if it is valid.

    Any other exception propagates and fails the test. A valid file must hand out every tensor."""
    FUZZ_CASES[counter] += 1
    # A fresh name per case: truncating and rewriting one file makes ext4 flush it (auto_da_alloc),
    # which costs ~3 ms of wall time per case.
    path = directory / f"case-{sum(FUZZ_CASES.values())}.nanoqwen"
    path.write_bytes(data)
    try:
        with NanoQwenFile(path, verify_data=True) as f:
            expected = stored_tensors(f.config, f.lm_head_int4)
            for name in f.names:
                dtype, shape = expected[name]
                view = f.tensor(name)
                assert view.dtype == dtype and view.shape == shape and f.offset(name) + view.nbytes <= len(data)
    except FormatError as err:
        assert str(err).startswith(str(path)) and "\n" not in str(err)
        return err
    finally:
        path.unlink()
    return None


def _shorten_tokenizer_blob(f: Forge) -> None:
    """Drop the blob's last byte and zero it, so the framing check (not the padding check) fires."""
    h = f.header
    f.buf[h.tokenizer_offset + h.tokenizer_length - 1] = 0
    f.set_header(tokenizer_length=h.tokenizer_length - 1)


MALICIOUS = {
    "version-bump": (lambda f, d: f.set_header(version=2), "format version 2 is not supported"),
    "version-zero": (lambda f, d: f.set_header(version=0), "format version 0"),
    "header-size-small": (lambda f, d: f.set_header(header_size=255), "header_size is 255"),
    "header-size-huge": (lambda f, d: f.set_header(header_size=2**32 - 1), "header_size is 4294967295"),
    "file-size-lie": (lambda f, d: f.set_header(file_size=len(d) + 4096), "file_size says"),
    "table-count-huge": (lambda f, d: f.set_header(table_count=2**64 - 1), "does not fit"),
    "table-count-2^57": (lambda f, d: f.set_header(table_count=2**57), "does not fit"),
    "table-count-zero": (lambda f, d: f.set_header(table_count=0), "does not fit"),
    "table-count-short": (lambda f, d: f.set_header(table_count=f.header.table_count - 1), "table has"),
    "table-offset-past-eof": (lambda f, d: f.set_header(table_offset=len(d)), "does not fit"),
    "table-offset-huge": (lambda f, d: f.set_header(table_offset=2**64 - 1), "does not fit"),
    "table-offset-in-header": (lambda f, d: f.set_header(table_offset=128), "does not fit"),
    "entry-size-lie": (lambda f, d: f.set_header(table_entry_size=64), "table_entry_size"),
    "tokenizer-past-eof": (lambda f, d: f.set_header(tokenizer_offset=len(d) - 10), "tokenizer blob"),
    "tokenizer-length-huge": (lambda f, d: f.set_header(tokenizer_length=2**64 - 1), "tokenizer blob"),
    "tokenizer-length-short": (lambda f, d: _shorten_tokenizer_blob(f), "json_length"),
    "tokenizer-json-length-lie": (lambda f, d: f.set_prelude(json_length=2**64 - 1), "json_length"),
    "tokenizer-has-template-2": (lambda f, d: f.set_prelude(has_template=2), "malformed prelude"),
    "tokenizer-pad-nonzero": (lambda f, d: f.set_prelude(pad=b"\1" + bytes(6)), "malformed prelude"),
    "tokenizer-not-utf8": (lambda f, d: f.buf.__setitem__(f.header.tokenizer_offset + 24, 0xFF), "UTF-8"),
    "hidden-size-max": (lambda f, d: f.set_header(hidden_size=2**32 - 1), "invalid model config"),
    "heads-zero": (lambda f, d: f.set_header(num_kv_heads=0), "num_kv_heads must be a positive"),
    "layers-huge": (lambda f, d: f.set_header(num_layers=2**32 - 1), "num_layers 4294967295"),
    "layers-two": (lambda f, d: f.set_header(num_layers=2), "table has 23 entries but this config stores 42"),
    "vocab-double": (lambda f, d: f.set_header(vocab_size=512), "shape"),
    "rope-theta-nan": (lambda f, d: f.set_header(rope_theta=float("nan")), "rope_theta is nan"),
    "rope-theta-inf": (lambda f, d: f.set_header(rope_theta=float("inf")), "not a finite"),
    "eps-negative": (lambda f, d: f.set_header(rms_norm_eps=-1e-6), "must be positive"),
    "flag-two": (lambda f, d: f.set_header(qkv_bias=2), "qkv_bias is 2, expected 0 or 1"),
    "qkv-bias-zero": (lambda f, d: f.set_header(qkv_bias=0), "qkv_bias=False is not supported"),
    "bos-max": (lambda f, d: f.set_header(bos_token_id=2**32 - 1),
                "bos_token_id 4294967295 is not a token id of the 256-token vocabulary"),
    "eos-max": (lambda f, d: f.set_header(eos_token_id=2**32 - 1),
                "eos_token_id 4294967295 is not a token id of the 256-token vocabulary"),
    "eos-vocab": (lambda f, d: f.set_header(eos_token_id=256), "eos_token_id 256 is not a token id"),
    "context-max": (lambda f, d: f.set_header(max_position_embeddings=2**32 - 1),
                    "max_position_embeddings 4294967295 is beyond 2147483647"),
    "extra-eos-count": (lambda f, d: f.set_header(extra_eos_count=9), "extra_eos_count is 9"),
    "extra-eos-unused-slot": (lambda f, d: f.set_header(extra_eos_ids=bytes(31) + b"\1"), "unused extra_eos_ids"),
    "extra-eos-past-vocab": (lambda f, d: f.set_header(extra_eos_count=1,
                                                       extra_eos_ids=struct.pack("<8I", 256, *[0] * 7)),
                             "extra end-of-generation id 256 is not a token id of the 256-token vocabulary"),
    # Tied + INT4 lm_head stores the same names as untied + INT4, so only flag pairs change the set.
    "tied-fp16-lm-head": (lambda f, d: f.set_header(tie_word_embeddings=1, lm_head_int4=0), "stores 21 tensors"),
    "lm-head-flip": (lambda f, d: f.set_header(lm_head_int4=0), "stores 22 tensors"),
    "quant-scheme": (lambda f, d: f.set_header(quant_scheme=2), "quant_scheme 2"),
    "group-size": (lambda f, d: f.set_header(group_size=64), "group_size is 64"),
    "alignment": (lambda f, d: f.set_header(alignment=512), "alignment is 512"),
    "reserved": (lambda f, d: f.set_header(reserved=b"\1" + bytes(119)), "reserved bytes"),
    "offset-past-eof": (lambda f, d: f.set_entry(3, offset=len(d) // 4096 * 4096 + 4096), "runs past the end"),
    "offset-overflow": (lambda f, d: f.set_entry(3, offset=2**64 - 4096), "runs past the end"),
    "offset-misaligned": (lambda f, d: f.set_entry(3, offset=f.entry(3).offset + 2), "not a multiple of 4096"),
    "offset-into-header": (lambda f, d: f.set_entry(3, offset=0), "overlaps"),
    "tensors-overlap": (lambda f, d: f.set_entry(3, offset=f.entry(4).offset), "overlaps"),
    "nbytes-lie": (lambda f, d: f.set_entry(0, nbytes=f.entry(0).nbytes + 4096), "nbytes is"),
    "nbytes-huge": (lambda f, d: f.set_entry(0, nbytes=2**64 - 1), "nbytes is"),
    "shape-swapped": (lambda f, d: f.set_entry(0, dim0=f.entry(0).dim1, dim1=f.entry(0).dim0), "shape"),
    "ndim-3": (lambda f, d: f.set_entry(0, ndim=3, dim2=1), "ndim 3"),
    "ndim-255": (lambda f, d: f.set_entry(0, ndim=255), "ndim 255"),
    "unused-dim-set": (lambda f, d: f.set_entry(0, dim3=7), "unused dims"),
    "dtype-unknown": (lambda f, d: f.set_entry(0, dtype=9), "dtype code 9"),
    "dtype-swapped": (lambda f, d: f.set_entry(0, dtype=2), "dtype code 2"),
    "name-not-utf8": (lambda f, d: f.set_entry(0, name=b"model.\xff\xfe", name_length=8), "not valid UTF-8"),
    "name-unknown": (lambda f, d: f.set_entry(0, name=b"model.evil", name_length=10), "not a tensor of this"),
    "name-length-zero": (lambda f, d: f.set_entry(0, name_length=0), "name_length 0"),
    "name-length-huge": (lambda f, d: f.set_entry(0, name_length=65535), "name_length 65535"),
    "name-not-padded": (lambda f, d: f.set_entry(0, name=f.entry(0).name[:-1] + b"x"), "zero-padded"),
    "name-duplicate": (lambda f, d: f.set_entry(1, name=f.entry(0).name, name_length=f.entry(0).name_length),
                       "appears twice"),
    "padding-nonzero": (lambda f, d: f.buf.__setitem__(f.entry(1).offset + f.entry(1).nbytes, 1), "padding bytes"),
    "data-crc-lie": (lambda f, d: f.set_entry(0, crc32=f.entry(0).crc32 ^ 1), "data checksum mismatch"),
}


@pytest.mark.parametrize("case", list(MALICIOUS))
def test_forged_field_is_rejected_with_a_clear_message(small_file, fuzz_dir, case):
    forge, message = MALICIOUS[case]
    f = Forge(small_file)
    forge(f, small_file)
    err = open_forged(fuzz_dir, f.sealed(), "forged, hand-written")
    assert err is not None and re.search(message, str(err)), err


def test_unsealed_edits_fail_the_checksums(small_file, fuzz_dir):
    f = Forge(small_file).set_header(rope_theta=10000.0)
    assert "header: checksum mismatch" in str(open_forged(fuzz_dir, bytes(f.buf), "forged, hand-written"))
    f = Forge(small_file)
    f.buf[f.header.tokenizer_offset + 30] ^= 0x20
    assert "tokenizer blob (offset" in str(open_forged(fuzz_dir, bytes(f.buf), "forged, hand-written"))


def test_verify_data_is_what_catches_corrupt_tensor_data(small_file, fuzz_dir):
    f = Forge(small_file)
    first = f.entry(0)
    f.buf[first.offset + 1000] ^= 0x01
    path = fuzz_dir / "corrupt-data.nanoqwen"
    path.write_bytes(f.buf)
    with NanoQwenFile(path, verify_data=False) as loaded:  # structure is intact: it loads
        assert loaded.tensor(first.name.rstrip(b"\0").decode()).shape == (first.dim0, first.dim1)
    with pytest.raises(FormatError, match="'model.embed_tokens.weight': data checksum mismatch"):
        NanoQwenFile(path, verify_data=True)


# ------------------------------------------------------------------------------------ fuzzing

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def regions_of(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges to aim corruption at: header, table, tokenizer blob, tensor data, anywhere."""
    forge = Forge(data)
    h = forge.header
    first_tensor = min(forge.entry(i).offset for i in range(h.table_count))
    return [(0, h.header_size), (h.table_offset, h.table_offset + h.table_count * ENTRY_SIZE),
            (h.tokenizer_offset, h.tokenizer_offset + h.tokenizer_length), (first_tensor, len(data)),
            (0, len(data))]


def report(counter: str, minimum: int) -> None:
    print(f"\n{counter}: {FUZZ_CASES[counter]} fuzz cases")
    assert FUZZ_CASES[counter] >= minimum


def test_fuzz_truncation_and_extension(small_file, fuzz_dir):
    data = small_file

    @settings(FUZZ, max_examples=300)
    @given(st.one_of(st.integers(0, len(data) - 1).map(lambda n: data[:n]),
                     st.binary(min_size=1, max_size=8192).map(lambda tail: data + tail)))
    def case(mutated):
        assert open_forged(fuzz_dir, mutated, "truncation/extension") is not None

    case()
    report("truncation/extension", 300)


def test_fuzz_single_bit_flips_are_all_detected(small_file, fuzz_dir):
    data = small_file
    bits = st.sampled_from(regions_of(data)).flatmap(lambda r: st.integers(8 * r[0], 8 * r[1] - 1))

    @settings(FUZZ, max_examples=1500)
    @given(bits)
    def case(bit):
        mutated = bytearray(data)
        mutated[bit // 8] ^= 1 << (bit % 8)
        assert open_forged(fuzz_dir, bytes(mutated), "single bit flip") is not None

    case()
    report("single bit flip", 1500)


def test_fuzz_byte_overwrites_are_detected(small_file, fuzz_dir):
    data = small_file
    positions = st.sampled_from(regions_of(data)).flatmap(lambda r: st.integers(r[0], r[1] - 1))

    @settings(FUZZ, max_examples=1000)
    @given(st.lists(st.tuples(positions, st.integers(0, 255)), min_size=1, max_size=16))
    def case(writes):
        mutated = bytearray(data)
        for at, value in writes:
            mutated[at] = value
        outcome = open_forged(fuzz_dir, bytes(mutated), "byte overwrites")
        # CRC-32 misses a random multi-byte change with probability 2^-32: treat any miss as a bug.
        assert (outcome is None) == (mutated == data)

    case()
    report("byte overwrites", 1000)


def _values(code: str, file_size: int) -> st.SearchStrategy:
    """Values for one struct field: edge cases, sizes near the file's, and anything at all."""
    if code == "d":
        return st.one_of(st.sampled_from([0.0, -0.0, -1.0, 5e-324, 1e308]), st.floats())
    if code.endswith("s"):
        n = int(code[:-1])
        return st.one_of(st.just(bytes(n)), st.binary(min_size=n, max_size=n))
    top = 2 ** {"B": 8, "H": 16, "I": 32, "Q": 64}[code] - 1
    edges = [0, 1, 2, 3, 88, 127, 128, 255, 256, 4095, 4096, 4097, file_size - 4096, file_size - 1,
             file_size, file_size + 1, (top + 1) // 2 - 1, (top + 1) // 2, top - 4095, top]
    return st.one_of(st.sampled_from([v for v in edges if 0 <= v <= top]), st.integers(0, top))


RESEALED = {"header_crc32", "tokenizer_crc32"}  # sealed() recomputes these, editing them is moot
PRELUDE_FIELDS = (("json_length", "Q"), ("template_length", "Q"), ("has_template", "B"), ("pad", "7s"))


@st.composite
def forged_edits(draw, data: bytes):
    """1..4 edits of header, table entry, entry name or tokenizer prelude fields."""
    count = HEADER.unpack_from(data, 0)[Header._fields.index("table_count")]
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        target = draw(st.sampled_from(["header", "entry", "name", "prelude"]))
        if target == "header":
            field, code = draw(st.sampled_from([fc for fc in HEADER_FIELDS if fc[0] not in RESEALED]))
            edits.append(("header", None, {field: draw(_values(code, len(data)))}))
        elif target == "entry":
            field, code = draw(st.sampled_from(ENTRY_FIELDS))
            edits.append(("entry", draw(st.integers(0, count - 1)), {field: draw(_values(code, len(data)))}))
        elif target == "name":
            name = draw(st.one_of(st.text(max_size=30).map(lambda t: t.encode()[:88]), st.binary(max_size=88)))
            length = draw(st.one_of(st.just(len(name)), st.integers(0, 2**16 - 1)))
            edits.append(("entry", draw(st.integers(0, count - 1)), {"name": name, "name_length": length}))
        else:
            field, code = draw(st.sampled_from(PRELUDE_FIELDS))
            edits.append(("prelude", None, {field: draw(_values(code, len(data)))}))
    # Header edits last: entry and prelude edits locate their bytes through the original header.
    return sorted(edits, key=lambda edit: edit[0] == "header")


def test_fuzz_forged_fields_with_resealed_checksums(small_file, fuzz_dir):
    data = small_file
    accepted = Counter()

    @settings(FUZZ, max_examples=2000)
    @given(forged_edits(data))
    def case(edits):
        f = Forge(data)
        for target, index, fields in edits:
            if target == "header":
                f.set_header(**fields)
            elif target == "entry":
                f.set_entry(index, **fields)
            else:
                f.set_prelude(**fields)
        forged = f.sealed()
        if open_forged(fuzz_dir, forged, "forged fields, resealed") is None and forged != data:
            # Accepted and different: an edit that still describes a valid file (e.g. another eos id).
            accepted[", ".join(sorted({k for _, _, fields in edits for k in fields}))] += 1

    case()
    print(f"\nforged files that changed bytes and were still valid, by edited fields: {dict(accepted)}")
    report("forged fields, resealed", 2000)


# ------------------------------------------------------------------------------------ info command

def test_info_prints_a_summary(tmp_path):
    path = tmp_path / "m.nanoqwen"
    tensors = random_tensors(TINY, True, np.random.default_rng())
    write_file(path, TINY, True, tensors)
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert describe(path) + "\n" == result.stdout
    out = result.stdout
    assert "NANOQWEN version 1" in out and f"{path.stat().st_size:,} bytes" in out
    assert "hidden_size               256" in out and "rope_theta                1000000.0" in out
    assert f"tokenizer.json {len(TOKENIZER_JSON):,} bytes (2 tokens of the {TINY.vocab_size:,}-id vocabulary)" in out
    assert f"chat template {len(CHAT_TEMPLATE.encode()):,} bytes" in out
    n_fp16 = sum(t.dtype == np.float16 for t in tensors.values())
    fp16_bytes = sum(t.nbytes for t in tensors.values() if t.dtype == np.float16)
    assert f"float16                   {n_fp16:>5} tensors {fp16_bytes:>16,} bytes" in out
    assert "(4.125 bits/weight)" in out  # 4 bits + one FP16 scale per 128 weights
    assert "lm_head.weight.qweight" in out and "lm_head INT4" in out


def test_info_on_a_corrupt_file_prints_one_error_line(tmp_path):
    path = tmp_path / "m.nanoqwen"
    write_file(path, SMALL, False, random_tensors(SMALL, False, np.random.default_rng()))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "data checksum mismatch" in result.stderr
    # The real entry point, as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "pynanoqwen", "info", str(tmp_path / "absent.nanoqwen")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: {tmp_path / 'absent.nanoqwen'}: no such file\n"


# ------------------------------------------------------------------------------------ end-of-generation ids

def test_extra_eos_ids_round_trip_in_the_formerly_reserved_bytes(tmp_path):
    """The ids sit at bytes 216..251 (count, then 8 uint32 slots); a file without them keeps those
    bytes zero, exactly as files written before the field existed."""
    path = tmp_path / "m.nanoqwen"
    tensors = random_tensors(SMALL, True, np.random.default_rng())
    with NanoQwenWriter(path, SMALL, lm_head_int4=True, tokenizer_json=TOKENIZER_JSON, chat_template=None,
                        extra_eos_ids=(7, 255)) as writer:
        for name, array in tensors.items():
            writer.add_tensor(name, array)
    data = path.read_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == 1 and data[132:216] == bytes(84)
    assert struct.unpack_from("<9I", data, 216) == (2, 7, 255, 0, 0, 0, 0, 0, 0)
    with NanoQwenFile(path) as f:
        assert f.extra_eos_ids == (7, 255) and f.version == 1
    assert "end of generation eos_token_id 2; extra ids 7, 255" in describe(path)
    write_file(path, SMALL, True, tensors)
    with NanoQwenFile(path) as f:
        assert f.extra_eos_ids == ()
    assert path.read_bytes()[132:252] == bytes(120)


def test_the_embedded_model_written_before_the_field_still_loads():
    from pynanoqwen.data import EMBEDDED_MODEL

    with NanoQwenFile(EMBEDDED_MODEL) as f:
        assert f.extra_eos_ids == () and f.version == 1 and f.config.eos_token_id == 0


@pytest.mark.parametrize("ids, message", [
    (tuple(range(3, 12)), "9 end-of-generation ids besides eos_token_id; the header holds at most 8"),
    ((256,), "extra end-of-generation id 256 must be a token id below vocab_size 256"),
    ((2,), "other than eos_token_id"),
    ((5, 5), "given once"),
    ((-1,), "extra end-of-generation id -1"),
])
def test_writer_refuses_bad_extra_eos_ids(tmp_path, ids, message):
    with pytest.raises(FormatError, match=message):
        NanoQwenWriter(tmp_path / "m.nanoqwen", SMALL, lm_head_int4=True, tokenizer_json=b"{}",
                       chat_template=None, extra_eos_ids=ids)
    assert list(tmp_path.iterdir()) == []


def test_leftover_temp_files_are_found_by_name(tmp_path):
    from pynanoqwen.filewriter import leftover_temp_files, temp_path

    out = tmp_path / "m.nanoqwen"
    mine = temp_path(out)
    for name in (mine.name, "m.nanoqwen.tmp.12.0123abcd", "m.nanoqwen.tmp.x.0123abcd", "other.nanoqwen.tmp.3.0123abcd",
                 "m.nanoqwen.tmp.12.0123abcd.bak", "m.nanoqwen"):
        (tmp_path / name).write_bytes(b"")
    assert leftover_temp_files(out) == sorted([(mine, os.getpid()), (tmp_path / "m.nanoqwen.tmp.12.0123abcd", 12)])
    assert leftover_temp_files(tmp_path / "absent-dir" / "m.nanoqwen") == []
