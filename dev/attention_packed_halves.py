"""Decode attention whose P V mma carries P's FP16 remainder in its empty rows 8..15, against the
product's kernel (kernels/attention_decode.py), which spends a second mma on it.

The product keeps float32 precision on FP16 tensor cores by splitting q and the weights P each
into an FP16 high part and an FP16 remainder. For S = Q K^T it already packs q's remainder into
the A tile's rows 8..15 ("S only" here until it was promoted: bit for bit the two-chain kernel's
on an H100, docs/PERFORMANCE.md, 2026-12-07 night); for O += P V it still runs one mma a part,
with the A rows 8..15 zero: 48 `mma.m16n8k16` a page a consumer warp, 16 for S and 32 for P V
(16 dim n tiles x 2 parts). Here P's remainder goes into rows 8..15 of the same A fragment
(registers a1 and a3, rows gid + 8), so one mma computes both parts: D rows gid hold the high
part's products, rows gid + 8 the remainder's, in the same lane (c0, c1 and c2, c3), and 32 mma a
page remain. Rows gid + 8 of the accumulator start from zero each page and are added to the
running O (rows gid) after the mma: O += (P_hi V + O) + P_lo V becomes O = (O + P_hi V) + (P_lo
V), one float32 rounding more a page of 16 keys, inside oracles.attention_oracle's bound (one
rounding a key for the accumulators). So O's bits differ from the product's; both are within the
bound.

Counted before the first run (on the two-chain product): a page costs a consumer ~1.3 us, and at
32000 tokens the page phase is bound by its data path (dev/attention_page_phase.py), so packing
changes little there and shortens a short context's chain a little (a page's P V becomes one mma
and an add a dim tile, not two dependent mma). Measured on an H100 (docs/PERFORMANCE.md): 0.1-0.5
us a launch against the two-chain product, of which the packed S, now promoted, took 0.1-0.4.
Two blocks a SM (its fewer registers allow 10 warps of 192 in 65536) lost everywhere.

    python dev/attention_packed_halves.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     seven_b_attention, time_decode_attention, variant_compile_target)

E20 = " " * 20
PV_EDIT = (
    E20 + "o = 4 * jp\n"
    + E20 + "acc[o], acc[o + 1], _, _ = mma_m16n8k16(p0_hi, NONE, p1_hi, NONE, b0, b1, acc[o], acc[o + 1],\n"
    + E20 + "                                        ZERO, ZERO)\n"
    + E20 + "acc[o], acc[o + 1], _, _ = mma_m16n8k16(p0_lo, NONE, p1_lo, NONE, b0, b1, acc[o], acc[o + 1],\n"
    + E20 + "                                        ZERO, ZERO)\n"
    + E20 + "acc[o + 2], acc[o + 3], _, _ = mma_m16n8k16(p0_hi, NONE, p1_hi, NONE, b2, b3, acc[o + 2],\n"
    + E20 + "                                            acc[o + 3], ZERO, ZERO)\n"
    + E20 + "acc[o + 2], acc[o + 3], _, _ = mma_m16n8k16(p0_lo, NONE, p1_lo, NONE, b2, b3, acc[o + 2],\n"
    + E20 + "                                            acc[o + 3], ZERO, ZERO)\n",
    # P's high part in rows gid (onto O), its remainder in rows gid + 8 (from zero), then added.
    E20 + "o = 4 * jp\n"
    + E20 + "hi0, hi1, lo0, lo1 = mma_m16n8k16(p0_hi, p0_lo, p1_hi, p1_lo, b0, b1, acc[o], acc[o + 1], ZERO, ZERO)\n"
    + E20 + "acc[o], acc[o + 1] = hi0 + lo0, hi1 + lo1\n"
    + E20 + "hi0, hi1, lo0, lo1 = mma_m16n8k16(p0_hi, p0_lo, p1_hi, p1_lo, b2, b3, acc[o + 2], acc[o + 3], ZERO,\n"
    + E20 + "                                  ZERO)\n"
    + E20 + "acc[o + 2], acc[o + 3] = hi0 + lo0, hi1 + lo1\n",
)


def load_variant():
    return load_source(edited_kernel_source("attention_packed_halves", "", [PV_EDIT]), "attention_packed_halves")


def builders() -> dict:
    """name -> build(max_pages): the product's kernel, the packed form, and the packed form at two
    blocks a SM (twice the splits, half the ring each)."""
    packed = load_variant()
    return {"product": seven_b_attention(), "packed": seven_b_attention(packed),
            "packed, 2 blocks a SM": seven_b_attention(packed, two_blocks_a_sm=True)}


def check(rng):
    """One split up to every split holding pages, partial last pages; each launched twice."""
    return check_decode_attention(builders(), (1, 16, 17, 545, 4096, 32768), rng, launches=2)


def timings() -> list[dict]:
    return time_decode_attention(builders(), (16, 545, 4096, 16384, 32000))


def compile_targets():
    """The packed form at 7B shapes, for tests/test_dev_variants.py's compile check."""
    module = load_variant()
    splits = module.default_num_splits(SEVEN_B.num_kv_heads, 132)
    return [variant_compile_target(module, f"decode_attention packed[{splits} splits]", None, splits)]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: P's FP16 remainder in the P V mma's empty rows against a second mma")
