"""One decode-attention call at Qwen2.5-7B shapes, checked against numpy: a target for compute-sanitizer.

Builds the kernel (28 query heads, 4 KV heads, head_dim 128, default splits), fills a shuffled
paged cache with random K/V for `--context` tokens (NaN everywhere else, so a read outside the
context shows up in the result), runs the kernel once and compares with float64 softmax attention.
The default context, 4000 tokens (250 pages, 8 per split), makes every split wrap its 4-stage
ring twice, so the producer reuses stages the consumers have released: the case racecheck needs.
Exit status 0 when the result matches, 1 when it does not.

    compute-sanitizer --tool memcheck  python scripts/attention_sanitize.py
    compute-sanitizer --tool racecheck python scripts/attention_sanitize.py
    compute-sanitizer --tool synccheck python scripts/attention_sanitize.py --context 40
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from numba import cuda

from pynanoqwen.kernels.attention_decode import PAGE_SIZE, make_decode_attention
from pynanoqwen.kernels.kv_layout import swizzle_rows

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128


def reference_attention(q, k_pages, v_pages, page_table, context):
    """softmax(q K^T / sqrt(d)) V in float64 over positions 0..context-1."""
    positions = np.arange(context)
    pages = page_table[positions // PAGE_SIZE]
    keys = k_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)
    values = v_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    out = np.empty((NUM_HEADS, HEAD_DIM))
    for h in range(NUM_HEADS):
        scores = keys[:, h // group] @ q[h].astype(np.float64) / np.sqrt(HEAD_DIM)
        weights = np.exp(scores - scores.max())
        out[h] = weights @ values[:, h // group] / weights.sum()
    return out.reshape(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4000, help="tokens in the cache (pos + 1)")
    parser.add_argument("--num-splits", type=int, default=None, help="splits per KV head")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    max_pages = (args.context + PAGE_SIZE - 1) // PAGE_SIZE + 8
    shape = (max_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    page_table = rng.permutation(max_pages).astype(np.int32)
    k_pages = np.full(shape, np.nan, np.float16)
    v_pages = np.full(shape, np.nan, np.float16)
    positions = np.arange(args.context)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k_pages[pages, :, slots] = rng.standard_normal((args.context, NUM_KV_HEADS, HEAD_DIM))
    v_pages[pages, :, slots] = rng.standard_normal((args.context, NUM_KV_HEADS, HEAD_DIM))
    q = (3.0 * rng.standard_normal((NUM_HEADS, HEAD_DIM))).astype(np.float32)

    attention = make_decode_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, max_pages, num_splits=args.num_splits)
    out = cuda.to_device(np.full(NUM_HEADS * HEAD_DIM, np.nan, np.float16))
    stream = cuda.stream()
    attention.launch(stream, cuda.to_device(q), cuda.to_device(swizzle_rows(k_pages)),
                     cuda.to_device(swizzle_rows(v_pages)),
                     cuda.to_device(page_table), cuda.to_device(np.array([args.context - 1], np.int32)), out)
    got = out.copy_to_host(stream=stream).astype(np.float64)
    stream.synchronize()

    expected = reference_attention(q, k_pages, v_pages, page_table, args.context)
    error = np.abs(got - expected).max() if np.isfinite(got).all() else np.inf
    ok = np.allclose(got, expected, rtol=2e-3, atol=2e-3)
    print(f"decode attention, context {args.context}, {attention.num_splits} splits x {NUM_KV_HEADS} "
          f"KV heads, {attention.stages} stages: max |error| {error:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
