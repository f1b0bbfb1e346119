"""Where decode attention's page phase goes: the product's kernel (kernels/attention_decode.py)
timed against itself with parts of its consumers' work left out. Timing only: the forms that
leave work out give wrong results, and only the product is checked against float64.

At 32000 tokens the page phase moves ~2.8 TB/s on the H200 whatever the number of consumers
(4 or 7), the ring's depth (16 to 24 stages) or ldmatrix's bank conflicts (docs/PERFORMANCE.md,
"Decode attention, 2026-12-04"), while dev/stream_read.py's ring of the same 4 KiB `cp.async.bulk`
copies from one producer lane, its consumers only waiting and releasing, reads at 96% of the copy
rate. What differs: the consumers' arithmetic, the random page order, two copies a stage, and a
ring released only once a consumer is done with a page. The forms:
- "no P V": the consumers compute S and the softmax (kept alive by the running sums they store)
  and skip O += P V and its ldmatrix reads;
- "copies only": the consumers wait for each page and release it at once, no arithmetic: the
  attention's own data movement (its page order, its two copies a stage, its ring) alone;
- "copies only, 2 blocks a SM": the same at twice the splits and half the ring a block, two
  producers a SM (its few registers fit).
Read against each other: if "copies only" streams near the copy rate, the consumers' work is what
bounds the phase and the "no P V" form says how much of it is P V; if "copies only" stays near the
product, the data path is the bound, and its two-block form says whether it is the block's (one
producer lane, one ring) or the SM's.

    python dev/attention_page_phase.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     seven_b_attention, time_decode_attention, variant_compile_target)

E16 = " " * 16
RELEASE = E16 + "mbarrier_arrive(empty, stage)  # this lane's reads of the stage are done\n"
# (start, end, replacement) sections of the consumer's page loop: the text from start up to end goes.
FORMS = {
    "no P V": [(E16 + "# O += P V: the S accumulators", RELEASE, "")],
    "copies only": [(E16 + "base = stage * PAGE_WORDS\n", RELEASE, "")],
}


def load_variant(form: str):
    return load_source(edited_kernel_source("attention_page_phase", "", [], sections=FORMS[form]),
                       "attention_page_phase_" + form.replace(" ", "_"))


def builders() -> dict:
    """name -> build(max_pages): the product and the forms that leave work out."""
    made = {"product": seven_b_attention()}
    made.update({form: seven_b_attention(load_variant(form)) for form in FORMS})
    made["copies only, 2 blocks a SM"] = seven_b_attention(load_variant("copies only"), two_blocks_a_sm=True)
    return made


def check(rng):
    """The product alone (the other forms compute something else on purpose), launched twice."""
    return check_decode_attention({"product": seven_b_attention()}, (545, 32768), rng, launches=2)


def timings() -> list[dict]:
    return time_decode_attention(builders(), (545, 4096, 16384, 32000))


def compile_targets():
    """The forms at 7B shapes, for tests/test_dev_variants.py's compile check (no mma or ldmatrix
    left in "copies only")."""
    targets = []
    for form in FORMS:
        module = load_variant(form)
        splits = module.default_num_splits(SEVEN_B.num_kv_heads, 132)
        drop = ("mma", "ldmatrix") if form == "copies only" else ("ldmatrix.sync.aligned.m8n8.x4.trans",)
        targets.append(variant_compile_target(module, f"decode_attention {form}[{splits} splits]", None, splits,
                                              drop=drop))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention's page phase: the product against itself with consumer work left out")
