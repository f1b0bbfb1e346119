"""docs/FORMAT.md's writer rules against the code: the CRC computed bit by bit from the parameters
the document states (read out of the document), one group's INT4 codes from the stated rounding,
the scale-underflow windows it describes, BF16 -> FP16 exactness, and its example file size."""

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from pynanoqwen.convert import fp16_blocks
from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.errors import CheckpointError
from pynanoqwen.fileformat import HEADER_SIZE, NanoQwenFile, align_up, header_crc32
from pynanoqwen.quant import quantize_int4, unpack_valueshuffle

FORMAT_MD = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text(encoding="utf-8")


def stated_crc_parameters() -> dict:
    """width, poly, init, refin, refout, xorout, check as FORMAT.md writes them."""
    found = re.search(r"width (\d+), poly (0x[0-9A-F]+), init (0x[0-9A-F]+), refin (true|false), refout "
                      r"(true|false), xorout\s+(0x[0-9A-F]+), check (0x[0-9A-F]+)", FORMAT_MD)
    assert found, "FORMAT.md no longer states the CRC parameters in catalogue form"
    width, poly, init, refin, refout, xorout, check = found.groups()
    return dict(width=int(width), poly=int(poly, 16), init=int(init, 16), refin=refin == "true",
                refout=refout == "true", xorout=int(xorout, 16), check=int(check, 16))


def reflect(value: int, bits: int) -> int:
    return int(f"{value:0{bits}b}"[::-1], 2)


def crc_bit_by_bit(data: bytes, width, poly, init, refin, refout, xorout, **_) -> int:
    """The catalogue ("Rocksoft") model, one bit at a time, MSB-first register; no tables, no zlib."""
    top, mask = 1 << (width - 1), (1 << width) - 1
    register = init
    for byte in data:
        register ^= (reflect(byte, 8) if refin else byte) << (width - 8)
        for _ in range(8):
            register = ((register << 1) ^ poly) & mask if register & top else (register << 1) & mask
    return (reflect(register, width) if refout else register) ^ xorout


def test_the_stated_crc_parameters_give_the_files_checksums():
    params = stated_crc_parameters()
    assert crc_bit_by_bit(b"123456789", **params) == params["check"]
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        h = f.header
        raw = EMBEDDED_MODEL.read_bytes()
        covered = raw[:HEADER_SIZE - 4] + raw[h.table_offset:h.table_offset + h.table_count * 128]
        assert crc_bit_by_bit(covered, **params) == h.header_crc32 == header_crc32(raw[:HEADER_SIZE],
                                                                                  covered[HEADER_SIZE - 4:])
        first = f.names[2]  # a norm weight, 512 bytes
        data = raw[f.offset(first):f.offset(first) + f.nbytes(first)]
        entry = struct.unpack_from("<QQI", raw, h.table_offset + 2 * 128)
        assert crc_bit_by_bit(data, **params) == entry[2]


def stated_group_codes(w: np.ndarray) -> tuple[np.float16, list[int]]:
    """FORMAT.md: s = fp16(float32(max|w|) / 7); q = clamp(rint(float32(w / s)), -7, 7) with ties
    to even, computed one weight at a time with numpy float32 scalars and Python's round()."""
    amax = max(abs(np.float32(x)) for x in w)
    s = np.float16(np.float32(amax) / np.float32(7))
    s32 = np.float32(s)
    codes = [0 if s32 == 0 else max(-7, min(7, round(float(np.float32(x) / s32)))) for x in w]
    return s, codes


def test_one_groups_codes_follow_the_stated_rounding():
    """s = 0.25 exactly (max|w| = 1.75), and weights on the half steps k s + s/2: half to even gives
    0, 2, 2, 4, 4, 6, 6 where half away from zero would give 1, 2, 3, 4, 5, 6, 7."""
    halves = [(k + 0.5) * 0.25 for k in range(7)]
    rng = np.random.default_rng(13)
    w = np.array(halves + [-x for x in halves] + [1.75, -1.75] + list(rng.uniform(-1.75, 1.75, 128 - 16)),
                 dtype=np.float32)
    qweight, scales = quantize_int4(w[None, :])
    s, codes = stated_group_codes(w)
    assert scales[0, 0] == s == np.float16(0.25)
    stored = unpack_valueshuffle(qweight)[0].astype(int) - 8
    assert stored.tolist() == codes
    assert stored[:7].tolist() == [0, 2, 2, 4, 4, 6, 6] and stored[7:14].tolist() == [0, -2, -2, -4, -4, -6, -6]


def dequantization_error_over_half_a_step(amax: float, rng) -> float:
    """max |w - w'| / (s/2) over a group whose largest weight is amax (in units of 2^-24)."""
    w = rng.uniform(-amax, amax, 128).astype(np.float32) * np.float32(2.0**-24)
    w[0] = np.float32(amax * 2.0**-24)
    qweight, scales = quantize_int4(w[None, :])
    s = np.float64(scales[0, 0])
    w_dq = (unpack_valueshuffle(qweight)[0].astype(np.float64) - 8) * s
    return np.inf if s == 0 else float(np.max(np.abs(w - w_dq)) / (s / 2))


def test_scale_underflow_windows_are_as_stated():
    rng = np.random.default_rng(5)
    zeros, _ = quantize_int4(np.full((1, 128), 7 * 2.0**-25, np.float32))
    assert (unpack_valueshuffle(zeros) == 8).all()  # s underflowed to 0: every weight stored as 0
    assert quantize_int4(np.full((1, 128), 7 * 2.0**-25, np.float32))[1][0, 0] == 0
    for k in range(1, 7):  # inside each stated window the bound fails, at its upper end for even k ...
        for amax in [7.5 * k + 0.01, (7.5 * k + 7 * k + 3.5) / 2, 7 * k + 3.5 - 0.01] + [7 * k + 3.5] * (k % 2 == 0):
            assert dequantization_error_over_half_a_step(amax, rng) > 1 + 2**-20, (k, amax)
    # ... and outside every window it holds: all normal scales and the subnormals from 7 x 2^-24 up.
    for amax in list(np.linspace(45.51, 60, 40)) + list(rng.uniform(60, 2.0**24, 200)) + \
            [7 * k + 3.5 for k in (1, 3, 5)] + [7 * k + 3.51 for k in range(1, 7)] + [7.5 * k for k in range(1, 7)]:
        assert dequantization_error_over_half_a_step(amax, rng) <= 1 + 8 * 2.0**-24, amax


def test_bf16_to_fp16_is_exact_in_fp16s_normal_range_and_beyond_65504_refused():
    bf16 = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    finite = bf16[np.isfinite(bf16)]
    normal = finite[(np.abs(finite) >= 2.0**-14) & (np.abs(finite) <= 65504)]
    assert (normal.astype(np.float16).astype(np.float32) == normal).all()
    assert np.abs(finite[np.abs(finite) > 65504]).min() == 65536  # no BF16 value lies between
    tiny = finite[(np.abs(finite) <= 2.0**-25)]
    assert (tiny.astype(np.float16) == 0).all()
    ok = fp16_blocks("t", (2,), [(0, np.array([65504.0, -65504.0], np.float32))])
    assert ok.tolist() == [65504.0, -65504.0]
    with pytest.raises(CheckpointError, match="magnitude 65504.5, beyond FP16's 65504"):
        fp16_blocks("t", (1,), [(0, np.array([65504.5], np.float32))])  # would round to 65504: refused


def test_the_example_file_size_follows_from_the_layout_rules():
    stated = re.search(r"tiny-coder.nanoqwen` \([^)]*\) is ([\d,]+) bytes", FORMAT_MD.replace("\n", " "))
    assert stated, "FORMAT.md no longer gives the embedded file's size"
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        end = HEADER_SIZE + 128 * len(f.names) + 24 + len(f.tokenizer_json) + len(f.chat_template.encode())
        for name in f.names:  # in table order, each tensor on the next multiple of 4096
            end = align_up(end) + f.nbytes(name)
        assert end == EMBEDDED_MODEL.stat().st_size == int(stated[1].replace(",", ""))
