"""INT4 symmetric group-wise quantization and the ValueShuffle nibble layout.

A linear layer W of shape [N, K] (out_features, in_features, as Hugging Face stores it) becomes
- `qweight`: uint32 [N, K // 8], each word holding 8 consecutive input elements of one row;
- `scales`:  float16 [N, K // 128], one scale per group of 128 consecutive input elements.

Quantization: s = max|w| / 7 over the group (rounded to FP16 first, so dequantization uses exactly
the stored scale), q = clamp(round(w / s), -7, 7), stored as the unsigned nibble u = q + 8.
Dequantization: w' = (u - 8) * s.

ValueShuffle: within one word, the 8 weights w0..w7 sit in nibble slots (slot p = bits 4p..4p+3)

    slot:    0   1   2   3   4   5   6   7
    weight: w0  w2  w1  w3  w4  w6  w5  w7

i.e. byte 0 = w0 | w2 << 4, byte 1 = w1 | w3 << 4, byte 2 = w4 | w6 << 4, byte 3 = w5 | w7 << 4.
Why: the GPU unpack does `prmt.b32 t, word, 0x64646464, 0x4140`, which puts byte 0 and byte 1 into
the low bytes of two FP16 halves whose high byte is 0x64 (= 1024.0). Masking t with 0x640F640F
leaves (1024 + w0, 1024 + w1); masking with 0x64F064F0 leaves (1024 + 16*w2, 1024 + 16*w3).
Selector 0x4342 does the same for bytes 2 and 3 (w4, w5) and (w6, w7). So two prmt and four ANDs
turn one word into four FP16 pairs in input order, ready to multiply against pairs of activations.
`unpack_prmt_reference` below is that exact bit sequence in numpy, the oracle for the GPU kernel.
"""

from __future__ import annotations

import numpy as np

from .config import GROUP_SIZE

# Slot p of a word holds weight SLOT_TO_WEIGHT[p] of its group of 8.
SLOT_TO_WEIGHT = np.array([0, 2, 1, 3, 4, 6, 5, 7])
QMAX = 7  # symmetric: codes -7..7, stored as nibbles 1..15 (nibble 0 is never written)


def quantize_int4(w: np.ndarray, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Quantize W [N, K] to (qweight uint32 [N, K/8] in ValueShuffle layout, scales f16 [N, K/g])."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % group_size or group_size % 8:
        raise ValueError(f"cannot quantize shape {w.shape} with group size {group_size}")
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    scales = (np.abs(groups).max(axis=2) / QMAX).astype(np.float16)
    s32 = scales.astype(np.float32)[:, :, None]
    # A group of zeros has scale 0; dividing by 1 instead stores zeros and dequantizes to zeros.
    q = np.rint(groups / np.where(s32 == 0, 1.0, s32))
    nibbles = (np.clip(q, -QMAX, QMAX) + 8).astype(np.uint8).reshape(n, k)
    return pack_valueshuffle(nibbles), scales


def pack_valueshuffle(nibbles: np.ndarray) -> np.ndarray:
    """Pack unsigned nibbles [N, K] (values 0..15, input order) into uint32 words [N, K/8]."""
    n, k = nibbles.shape
    by_word = nibbles.reshape(n, k // 8, 8).astype(np.uint32)
    words = np.zeros((n, k // 8), dtype=np.uint32)
    for slot, weight in enumerate(SLOT_TO_WEIGHT):
        words |= by_word[:, :, weight] << np.uint32(4 * slot)
    return words


def unpack_valueshuffle(words: np.ndarray) -> np.ndarray:
    """Inverse of pack_valueshuffle: uint32 [N, K/8] -> nibbles uint8 [N, K] in input order."""
    n, kw = words.shape
    out = np.empty((n, kw, 8), dtype=np.uint8)
    for slot, weight in enumerate(SLOT_TO_WEIGHT):
        out[:, :, weight] = (words >> np.uint32(4 * slot)) & np.uint32(0xF)
    return out.reshape(n, kw * 8)


def dequantize_int4(qweight: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """(qweight, scales) -> W' [N, K] in `dtype`, exactly (u - 8) * s."""
    nibbles = unpack_valueshuffle(np.asarray(qweight))
    n, k = nibbles.shape
    group_size = k // scales.shape[1]
    codes = nibbles.astype(dtype).reshape(n, scales.shape[1], group_size) - 8
    return (codes * np.asarray(scales).astype(dtype)[:, :, None]).reshape(n, k)


def prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """numpy model of PTX `prmt.b32 d, a, b, c` (default mode) for uint32 arrays.

    Bytes 0-3 of the pool are a's, bytes 4-7 are b's; output byte i is pool byte
    (selector >> 4i) & 7 (bit 3 of each selector nibble, sign replication, is not used here).
    """
    pool = (np.asarray(a, np.uint64) | (np.asarray(b, np.uint64) << np.uint64(32)))
    out = np.zeros(np.shape(pool), dtype=np.uint64)
    for i in range(4):
        src = (selector >> (4 * i)) & 7
        out |= ((pool >> np.uint64(8 * src)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def unpack_prmt_reference(words: np.ndarray) -> np.ndarray:
    """The GPU's unpack, bit for bit: uint32 words -> float16 codes (u - 8), shape [..., 8].

    For each word: two prmt.b32 against 0x64646464, four ANDs, then the FP16 arithmetic the kernel
    does: (1024 + u) - 1032 for low nibbles and (1024 + 16u) * (1/16) - 72 for high nibbles.
    """
    words = np.asarray(words, dtype=np.uint32)
    magic = np.uint32(0x64646464)
    out = np.empty(words.shape + (8,), dtype=np.float16)
    for sel, first in ((0x4140, 0), (0x4342, 4)):
        t = prmt(words, magic, sel)
        lo = (t & np.uint32(0x640F640F)).view(np.float16).reshape(words.shape + (2,))
        hi = (t & np.uint32(0x64F064F0)).view(np.float16).reshape(words.shape + (2,))
        out[..., first:first + 2] = lo - np.float16(1032)
        out[..., first + 2:first + 4] = hi * np.float16(1 / 16) - np.float16(72)
    return out
