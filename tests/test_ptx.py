"""The PTX primitives: each compiles inline for sm_90, and each simulator twin means what the
instruction means (checked against numpy and hand-written arithmetic, on fresh random inputs)."""

from fractions import Fraction

import numpy as np
import pytest
from numba import cuda, uint32

from pynanoqwen import quant
from pynanoqwen.kernels.gemv_int4_paths import FIXED_MAX, ROUNDER
from pynanoqwen.ptx.bits import bits_float, bits_float_simulated, float_bits, float_bits_simulated
from pynanoqwen.ptx.dp4a import dp4a, dp4a_simulated, dp4a_us, dp4a_us_simulated, dp4a_uu, dp4a_uu_simulated
from pynanoqwen.ptx.fma import fma, fma_simulated
from pynanoqwen.ptx.half2 import fma_f16x2, fma_f16x2_simulated, half2_to_float2, half2_to_float2_simulated
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32, ld_global_nc_v4_u32_simulated
from pynanoqwen.ptx.prmt import prmt, prmt_simulated
from pynanoqwen.ptx.warp import shfl_xor, warp_max, warp_sum


def use_prmt(a, out):
    i = cuda.grid(1)
    out[i] = prmt(a[i], a[i + 1], 0x4140)


def use_load(a, out):
    i = cuda.grid(1)
    w0, w1, w2, w3 = ld_global_nc_v4_u32(a, 4 * i)
    out[i] = w0 ^ w1 ^ w2 ^ w3


def use_dp4a(a, out):
    i = cuda.grid(1)
    out[i] = dp4a(a[i], a[i + 1], 5)


def use_dp4a_unsigned(a, out):
    i = cuda.grid(1)
    out[i] = dp4a_us(a[i], a[i + 1], dp4a_uu(a[i + 2], a[i + 3], 5))


def use_bits(a, out):
    i = cuda.grid(1)
    out[i] = bits_float(float_bits(a[i]) ^ uint32(1))


def use_half2(a, out):
    i = cuda.grid(1)
    lo, hi = half2_to_float2(fma_f16x2(a[i], a[i + 1], a[i + 2]))
    out[i] = lo + hi


def use_fma(a, out):
    i = cuda.grid(1)
    out[i] = fma(a[i], a[i + 1], a[i + 2])


def use_warp(values, out):
    i = cuda.grid(1)
    out[i] = warp_sum(values[i]) + warp_max(values[i]) + shfl_xor(values[i], uint32(3))


U32, F32 = "uint32[::1]", "float32[::1]"


@pytest.mark.parametrize("kernel, signature, instructions", [
    (use_prmt, f"void({U32}, {U32})", ["prmt.b32"]),
    (use_load, f"void({U32}, {U32})", ["ld.global.nc.v4.u32"]),
    (use_dp4a, f"void({U32}, int32[::1])", ["dp4a.s32.s32"]),
    (use_dp4a_unsigned, f"void({U32}, int32[::1])", ["dp4a.u32.s32", "dp4a.u32.u32"]),
    (use_bits, f"void({F32}, {F32})", ["mov.b32"] * 2),
    (use_half2, f"void({U32}, {F32})", ["fma.rn.f16x2", "cvt.f32.f16"]),
    (use_fma, f"void({F32}, {F32})", ["fma.rn.f32"]),
    (use_warp, f"void({F32}, {F32})", ["shfl.sync.bfly.b32"] * 11),
])
def test_primitive_compiles_inline_for_sm90(kernel, signature, instructions):
    ptx, _ = cuda.compile_ptx(kernel, signature, cc=(9, 0))
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    for instruction in set(instructions):
        assert sum(line.startswith(instruction) or f" {instruction} " in f" {line} "
                   for line in code) >= instructions.count(instruction), instruction
    assert not any(line.startswith("call") for line in code)


def test_prmt_twin_matches_numpy_model():
    rng = np.random.default_rng()
    a, b = rng.integers(0, 2**32, size=(2, 200), dtype=np.uint32)
    for selector in [0x4140, 0x4342, 0x3210, 0x7654, *rng.integers(0, 0x8000, size=20)]:
        selector = int(selector) & 0x7777  # quant.prmt models the default mode without sign bits
        expected = quant.prmt(a, b, selector)
        assert [prmt_simulated(x, y, selector) for x, y in zip(a, b)] == expected.tolist()


def test_prmt_twin_sign_replication():
    # Selector nibble 8 | i: byte i's top bit copied into all 8 bits (PTX ISA prmt, default mode).
    assert prmt_simulated(0x80_7F_01_FF, 0, 0x8888) == 0xFF_FF_FF_FF  # byte 0 = 0xFF: negative
    assert prmt_simulated(0x80_7F_01_FF, 0, 0x9999) == 0x00_00_00_00  # byte 1 = 0x01: positive
    assert prmt_simulated(0x80_7F_01_FF, 0, 0xB3A2) == 0xFF_80_00_7F  # sign(byte 3), 3, sign(2), 2


def test_prmt_unpack_reproduces_quant_reference():
    """Two prmt + four ANDs + the FP16 offset removal (simulated) give quant.unpack_prmt_reference."""
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    one, minus_1032 = (int(np.array([v, v], np.float16).view(np.uint32)[0]) for v in (1.0, -1032.0))
    sixteenth, minus_72 = (int(np.array([v, v], np.float16).view(np.uint32)[0]) for v in (1 / 16, -72.0))
    for word, expected in zip(words, quant.unpack_prmt_reference(words)):
        got = []
        for selector in (0x4140, 0x4342):
            t = prmt_simulated(word, 0x64646464, selector)
            got += half2_to_float2_simulated(fma_f16x2_simulated(t & 0x640F640F, one, minus_1032))
            got += half2_to_float2_simulated(fma_f16x2_simulated(t & 0x64F064F0, sixteenth, minus_72))
        assert np.array_equal(np.array(got, np.float32), expected.astype(np.float32))


def test_dp4a_twin_is_a_signed_byte_dot_product():
    rng = np.random.default_rng()
    a, b = rng.integers(0, 2**32, size=(2, 500), dtype=np.uint32)
    c = rng.integers(-2**31, 2**31, size=500, dtype=np.int64)
    dots = (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(axis=1)
    expected = ((c + dots + 2**31) % 2**32 - 2**31).tolist()  # int32 wrap-around
    assert [dp4a_simulated(x, y, z) for x, y, z in zip(a, b, c)] == expected
    assert dp4a_simulated(0x0000_00FF, 0x0000_0002, 0) == -2  # 0xFF is -1 as a signed byte


def test_dp4a_unsigned_twins_read_their_bytes_as_typed():
    """dp4a.u32.u32 reads both operands' bytes unsigned, dp4a.u32.s32 the second one signed."""
    rng = np.random.default_rng()
    a, b = rng.integers(0, 2**32, size=(2, 500), dtype=np.uint32)
    c = rng.integers(-2**31, 2**31, size=500, dtype=np.int64)
    a_bytes = a.view(np.uint8).reshape(-1, 4).astype(np.int64)
    for twin, b_bytes in ((dp4a_uu_simulated, b.view(np.uint8)), (dp4a_us_simulated, b.view(np.int8))):
        dots = (a_bytes * b_bytes.reshape(-1, 4)).sum(axis=1)
        expected = ((c + dots + 2**31) % 2**32 - 2**31).tolist()  # int32 wrap-around
        assert [twin(x, y, z) for x, y, z in zip(a, b, c)] == expected
    assert dp4a_uu_simulated(0x0000_00FF, 0x0000_00FF, 0) == 255 * 255
    assert dp4a_us_simulated(0x0000_00FF, 0x0000_00FF, 0) == -255  # b's 0xFF is -1


def test_bits_twins_reinterpret_float32():
    rng = np.random.default_rng()
    values = rng.standard_normal(100).astype(np.float32)
    words = values.view(np.uint32)
    assert [float_bits_simulated(v) for v in values] == words.tolist()
    assert np.array_equal(np.array([bits_float_simulated(w) for w in words], np.float32), values)


def _round_to(exact: Fraction, dtype=np.float16):
    """Round an exact value to the nearest `dtype` value, ties to even: the neighbours compared by hand."""
    guess = dtype(float(exact))
    candidates = {guess, np.nextafter(guess, dtype(np.inf)), np.nextafter(guess, dtype(-np.inf))}
    finite = [c for c in candidates if np.isfinite(c)]
    bits = np.uint16 if dtype == np.float16 else np.uint32
    return min(finite, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(bits)) & 1))


def test_fma_f16x2_twin_rounds_once():
    rng = np.random.default_rng()
    a, b, c = (rng.standard_normal((3, 400)) * rng.choice([1e-3, 1.0, 30.0], size=(3, 400))).astype(np.float16)
    a[:50], b[:50] = np.float16(1 + 2**-10), np.float16(1 - 2**-11)  # products that need a sticky bit
    words = [np.stack([x[0::2], x[1::2]], axis=1).copy().view(np.uint32).ravel() for x in (a, b, c)]
    got = np.array([fma_f16x2_simulated(x, y, z) for x, y, z in zip(*words)], np.uint32).view(np.float16)
    expected = [_round_to(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                for x, y, z in zip(a, b, c)]
    assert got.view(np.uint16).tolist() == np.array(expected, np.float16).view(np.uint16).tolist()


def test_fma_twin_rounds_once():
    """Against the exact value rounded by hand, on random triples and on the fixed16 staging's
    fma(x, 32767 / max|x|, 1.5 * 2^23), where the simulator's own a * b + c rounds twice: products
    just above k + 1/2 (at most 2^-10 above, 9 fraction bits left in float32 at 15-bit magnitude)
    first become k + 1/2 and then the even neighbour. Those cases are built, so the test shows the
    twin is not the double rounding."""
    rng = np.random.default_rng()
    a, b, c = (rng.standard_normal((3, 600)) * rng.choice([1e-3, 1.0, 3e4], size=(3, 600))).astype(np.float32)
    inverse = np.float32(FIXED_MAX) / np.float32(3.0)  # staging a group whose largest |x| is 3
    halves = (2 * rng.integers(1, 2**14, 200) + 1) / 2.0  # k + 1/2 below 32767
    x = ((halves + rng.uniform(2**-14, 2**-10, 200)) / np.float64(inverse)).astype(np.float32)
    a, b, c = np.concatenate([a, x]), np.concatenate([b, np.full(200, inverse)]), np.concatenate([c, np.full(200, ROUNDER)])
    expected = np.array([_round_to(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)), np.float32)
                         for x, y, z in zip(a, b, c)], np.float32)
    got = np.array([fma_simulated(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    twice = a * b + c  # float32 numpy: the simulator's cuda.fma
    assert np.sum(twice[600:] != expected[600:]) > 10  # the built cases do tell one rounding from two


def test_half2_to_float2_twin_takes_low_half_first():
    rng = np.random.default_rng()
    pairs = rng.standard_normal((100, 2)).astype(np.float16)
    for (lo, hi), word in zip(pairs, pairs.copy().view(np.uint32).ravel()):
        got = half2_to_float2_simulated(word)
        assert got == (np.float32(lo), np.float32(hi)) and all(isinstance(v, np.float32) for v in got)


def test_load_twin_returns_four_words_and_rejects_misalignment():
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    assert ld_global_nc_v4_u32_simulated(words, 8) == tuple(words[8:12])
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        ld_global_nc_v4_u32_simulated(words, 6)

