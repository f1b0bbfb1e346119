"""Decode attention whose blocks publish their split's partial with one thread's fence, against
the product's kernel (kernels/attention_decode.py), in which every thread fences.

The product's blocks store their split's partial, and then every thread runs `cuda.threadfence()`
before the block barrier, thread 0's atomic that counts the block in, a second barrier and, in the
last block, a second fence by every thread. At context 16 the stores and the fence take 2.0 of a
launch's 7.1 us, from the consumers' partials meeting to the partial stored and fenced
(docs/PERFORMANCE.md, dev/attention_timeline.py). Here the block meets at its barrier first, and
thread 0 alone fences, counts the block in and, in the last block, fences again before a second
barrier releases the others to merge: the pattern of cooperative groups' grid synchronisation.
It is correct because a fence is cumulative (PTX ISA, memory consistency model): the barrier
orders the other threads' stores before thread 0's fence, so the fence publishes them with its own,
and the last block's threads read the partials only after the barrier that follows thread 0's
second fence. What it may save: 159 of the 160 threads' fences, if the fence's cost is per thread
and not the one wait for the SM's stores to reach L2 that every fence shares. Measured on the H200
(2026-12-03, docs/PERFORMANCE.md): nothing, so the cost is the shared wait.

The variant is the product's source with the edit below applied at import (its anchor must occur
once, so a change of the product's kernel stops this script instead of measuring something else).
tests/sim/test_attention_sim.py checks it in the simulator, tests/test_dev_variants.py compiles it;
on the GPU:

    python dev/attention_one_fence.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (SEVEN_B, check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     seven_b_attention, time_decode_attention, variant_compile_target)

E8, E12 = " " * 8, " " * 12
EDITS = [(
    E8 + "cuda.threadfence()\n"
    + E8 + "cuda.syncthreads()\n"
    + E8 + "if tid == 0:\n"
    + E12 + "last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == num_splits - 1\n"
    + E8 + "cuda.syncthreads()\n"
    + E8 + "if last_block[0] == 0:\n"
    + E12 + "return\n"
    + E8 + "cuda.threadfence()\n"
    + E8 + "if tid == 0:\n"
    + E12 + "arrivals[kv_head] = 0  # every block of this launch has counted; ready for the next\n",
    # One thread fences for the block, after the barrier that orders the block's stores before it.
    E8 + "cuda.syncthreads()\n"
    + E8 + "if tid == 0:\n"
    + E12 + "cuda.threadfence()\n"
    + E12 + "last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == num_splits - 1\n"
    + E12 + "if last_block[0] != 0:\n"
    + E12 + "    cuda.threadfence()\n"
    + E12 + "    arrivals[kv_head] = 0  # every block of this launch has counted; ready for the next\n"
    + E8 + "cuda.syncthreads()\n"
    + E8 + "if last_block[0] == 0:\n"
    + E12 + "return\n",
)]


def load_variant():
    return load_source(edited_kernel_source("attention_one_fence", "", EDITS), "attention_one_fence_kernel")


def builders() -> dict:
    """name -> build(max_pages): the product's kernel and the variant."""
    return {"product": seven_b_attention(), "one fence": seven_b_attention(load_variant())}


def check(rng):
    """Contexts of one split with pages up to all of them, and a partial page; each launched twice,
    so the second finds the counters the first one reset."""
    return check_decode_attention(builders(), (1, 16, 17, 128, 129, 512, 513, 4096, 32768), rng, launches=2)


def timings() -> list[dict]:
    return time_decode_attention(builders(), (16, 512, 4096, 32000))


def compile_targets():
    """The variant at 7B shapes, for tests/test_dev_variants.py's compile check."""
    module = load_variant()
    splits = module.default_num_splits(SEVEN_B.num_kv_heads, 132)
    return [variant_compile_target(module, f"decode_attention one fence[{splits} splits]", None, splits)]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: the split's partial published by one thread's fence against every thread's")
