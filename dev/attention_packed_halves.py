"""Decode attention whose mma tiles carry q's and P's FP16 remainders in their empty rows 8..15,
against the product's kernel (kernels/attention_decode.py), which spends a second mma on each.

The product keeps float32 precision on FP16 tensor cores by splitting q and the weights P each
into an FP16 high part and an FP16 remainder, and runs every mma twice, once a part, with the A
rows 8..15 zero (a KV head has at most 8 query heads). That is 64 `mma.m16n8k16` a page a
consumer warp: 32 for S = Q K^T (2 key n tiles x 8 k steps x 2 parts) and 32 for O += P V (16
dim n tiles x 2 parts). Here the remainder goes into rows 8..15 of the same A fragment (registers
a1 and a3, rows gid + 8), so one mma computes both parts: D rows gid hold the high part's
products, rows gid + 8 the remainder's, in the same lane (c0, c1 and c2, c3), and 32 mma a page
remain.
- S: the high and low chains the product ran as two mma chains are now the two row halves of one
  chain; each row of D depends only on its own row of A, so S, and with it P, has the product's
  bits.
- P V: rows gid + 8 of the accumulator start from zero each page and are added to the running
  O (rows gid) after the mma: O += (P_hi V + O) + P_lo V becomes O = (O + P_hi V) + (P_lo V), one
  float32 rounding more a page of 16 keys, inside oracles.attention_oracle's bound (one rounding a
  key for the accumulators). So O's bits differ from the product's; both are within the bound.
The "S only" form packs S and keeps the product's P V, which tells the two halves apart.

What it may save, counted before any run. The product's page costs a consumer ~1.3 us, ~2600
cycles (docs/PERFORMANCE.md), and at 32000 tokens its page phase moves ~2.8 TB/s on the H200
whatever the number of consumers (4 or 7), the ring's depth or the bank conflicts: a bound shared
by a SM's warps or set by its block, not by one consumer's latency (not profiled). The tensor pipe
is one such bound, but by count a small one: at ~6 cycles a `mma.m16n8k16` a SM sub-partition
(mma.sync at about two thirds of the dense FP16 rate) a page's 64 take ~380 of those ~2600 cycles.
So the packed form should change little at long contexts (within a few percent at 32000) and
shorten a short context's chain a little (a page's P V becomes one mma and an add a dim tile, not
two dependent mma: ~0.1-0.3 us a launch at 545). Two blocks a SM double what a SM's blocks can
have in flight and issue (two producers, 8 consumers): if the bound is the block's, the page phase
gains up to ~1.5-2x at 16384-32000; if it is the SM's (its copy engine, the tensor pipe), nothing.

    python dev/attention_packed_halves.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     time_decode_attention, variant_compile_target)
from pynanoqwen.kernels import PAGE_SIZE  # noqa: E402
from pynanoqwen.kernels.attention_decode import make_decode_attention  # noqa: E402
from pynanoqwen.oracles import passed  # noqa: E402
from pynanoqwen.unit_checks import random_attention_case  # noqa: E402

E20, E24, E28 = " " * 20, " " * 24, " " * 28
S_EDIT = (
    E20 + "# The high and low parts of q accumulate in two chains (half the dependent mma\n"
    + E20 + "# latency), summed at the end.\n"
    + E20 + "c0, c1, d0, d1 = ZERO, ZERO, ZERO, ZERO\n"
    + E20 + "for kk2 in range(DIM_STEPS // 2):\n"
    + E24 + "b0, b1, b2, b3 = ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
    + E24 + "                             + 4 * ((4 * kk2 + lane // 8) ^ (lane % SWIZZLE_ROWS)))\n"
    + E24 + "a = 4 * kk2\n"
    + E24 + "c0, c1, _, _ = mma_m16n8k16(q_hi[a], NONE, q_hi[a + 1], NONE, b0, b1, c0, c1, ZERO, ZERO)\n"
    + E24 + "d0, d1, _, _ = mma_m16n8k16(q_lo[a], NONE, q_lo[a + 1], NONE, b0, b1, d0, d1, ZERO, ZERO)\n"
    + E24 + "c0, c1, _, _ = mma_m16n8k16(q_hi[a + 2], NONE, q_hi[a + 3], NONE, b2, b3, c0, c1, ZERO,\n"
    + E24 + "                            ZERO)\n"
    + E24 + "d0, d1, _, _ = mma_m16n8k16(q_lo[a + 2], NONE, q_lo[a + 3], NONE, b2, b3, d0, d1, ZERO,\n"
    + E24 + "                            ZERO)\n",
    # q's high part in rows gid, its remainder in rows gid + 8: one chain, D rows gid + 8 the low sums.
    E20 + "c0, c1, d0, d1 = ZERO, ZERO, ZERO, ZERO\n"
    + E20 + "for kk2 in range(DIM_STEPS // 2):\n"
    + E24 + "b0, b1, b2, b3 = ldmatrix_x4(words, K_RING + base + (8 * j + lane % 8) * SMEM_ROW_WORDS\n"
    + E24 + "                             + 4 * ((4 * kk2 + lane // 8) ^ (lane % SWIZZLE_ROWS)))\n"
    + E24 + "a = 4 * kk2\n"
    + E24 + "c0, c1, d0, d1 = mma_m16n8k16(q_hi[a], q_lo[a], q_hi[a + 1], q_lo[a + 1], b0, b1, c0, c1, d0, d1)\n"
    + E24 + "c0, c1, d0, d1 = mma_m16n8k16(q_hi[a + 2], q_lo[a + 2], q_hi[a + 3], q_lo[a + 3], b2, b3, c0, c1,\n"
    + E24 + "                              d0, d1)\n",
)
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
FORMS = {"packed": [S_EDIT, PV_EDIT], "S only": [S_EDIT]}


def load_variant(form: str = "packed"):
    return load_source(edited_kernel_source("attention_packed_halves", "", FORMS[form]),
                       "attention_packed_halves_" + form.replace(" ", "_"))


def builders() -> dict:
    """name -> build(max_pages): the product's kernel, the two packed forms, and the packed form at
    two blocks a SM (twice the splits, half the ring each), which its 185 registers allow (10 warps
    of 192 fit 65536; the product's 219 do not)."""
    heads, kv_heads, head_dim = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim
    forms = {form: load_variant(form) for form in FORMS}
    made = {"product": lambda max_pages: make_decode_attention(heads, kv_heads, head_dim, max_pages)}
    for form, module in forms.items():
        made[form] = lambda max_pages, m=module: m.make_decode_attention(heads, kv_heads, head_dim, max_pages)
    splits = 2 * forms["packed"].default_num_splits(kv_heads)
    made["packed, 2 blocks a SM"] = lambda max_pages: forms["packed"].make_decode_attention(
        heads, kv_heads, head_dim, max_pages, num_splits=splits, stages=forms["packed"].STAGES // 2)
    return made


def check(rng):
    """One split up to every split holding pages, partial last pages; each launched twice. Then S
    only against the product, bit for bit, on the same inputs: the hardware's mma must keep D's rows
    apart as the simulator's twin does."""
    return (check_decode_attention(builders(), (1, 16, 17, 545, 4096, 32768), rng, launches=2)
            + same_bits_as_product("S only", (17, 545, 4096, 32000), rng))


def same_bits_as_product(form: str, contexts: tuple[int, ...], rng) -> list:
    """Each context's output of `form` and of the product on the same fresh inputs, bit for bit."""
    heads, kv_heads, head_dim = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim
    max_pages = -(-max(contexts) // PAGE_SIZE)
    kernels = [make_decode_attention(heads, kv_heads, head_dim, max_pages),
               load_variant(form).make_decode_attention(heads, kv_heads, head_dim, max_pages)]
    results = []
    for context in contexts:
        inputs, _, _ = random_attention_case(rng, heads, kv_heads, head_dim, max_pages, context)
        device = [cuda.to_device(a) for a in inputs]
        outputs = []
        for attention in kernels:
            out = cuda.to_device(np.full(heads * head_dim, np.nan, np.float16))
            attention.launch(cuda.stream(), *device, out)
            outputs.append(out.copy_to_host().view(np.uint16))
        differ = int(np.sum(outputs[0] != outputs[1]))
        results.append(passed(f"{form} bits = product's, context {context}", differ == 0,
                              f"{differ} of {outputs[0].size} outputs differ"))
    return results


def timings() -> list[dict]:
    return time_decode_attention(builders(), (16, 545, 4096, 16384, 32000))


def compile_targets():
    """Both forms at 7B shapes, for tests/test_dev_variants.py's compile check."""
    targets = []
    for form in FORMS:
        module = load_variant(form)
        splits = module.default_num_splits(SEVEN_B.num_kv_heads, 132)
        targets.append(variant_compile_target(module, f"decode_attention {form}[{splits} splits]", None, splits))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: q's and P's FP16 remainders in the mma's empty rows against a second mma")
