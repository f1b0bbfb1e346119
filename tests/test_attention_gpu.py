"""Decode attention on the GPU at Qwen2.5-7B shapes (28 query heads, 4 KV heads, head_dim 128)
against float64 softmax attention over the gathered cache, and its speed inside a CUDA graph.

Slots outside the context hold NaN and the page table is a random permutation, as in
tests/sim/test_attention_sim.py; one kernel object (default splits: 4 x 33 blocks) serves every
context, as it does in the engine's captured graph.
"""

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.graphs import capture
from pynanoqwen.kernels.attention_decode import PAGE_SIZE, make_decode_attention
from pynanoqwen.kernels.kv_layout import swizzle_rows

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128
MAX_CONTEXT = 32768
MAX_PAGES = MAX_CONTEXT // PAGE_SIZE


def reference_attention(q, k_pages, v_pages, page_table, context):
    """softmax(q K^T / sqrt(d)) V in float64 over positions 0..context-1, per query head."""
    positions = np.arange(context)
    pages = page_table[positions // PAGE_SIZE]
    keys = k_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)  # [ctx, kv_heads, d]
    values = v_pages[pages, :, positions % PAGE_SIZE].astype(np.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    q_grouped = q.astype(np.float64).reshape(NUM_KV_HEADS, group, HEAD_DIM)
    scores = np.einsum("kgd,ckd->kgc", q_grouped, keys) / np.sqrt(HEAD_DIM)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = np.einsum("kgc,ckd->kgd", weights, values) / weights.sum(axis=-1)[..., None]
    return out.reshape(-1)


class Case:
    """Fresh random q and K/V pools for one context, on the host and the device."""

    def __init__(self, rng, context):
        self.context = context
        shape = (MAX_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
        self.page_table = rng.permutation(MAX_PAGES).astype(np.int32)
        self.k_pages = np.full(shape, np.nan, np.float16)
        self.v_pages = np.full(shape, np.nan, np.float16)
        positions = np.arange(context)
        pages, slots = self.page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
        self.k_pages[pages, :, slots] = rng.standard_normal((context, NUM_KV_HEADS, HEAD_DIM))
        self.v_pages[pages, :, slots] = rng.standard_normal((context, NUM_KV_HEADS, HEAD_DIM))
        self.q = (3.0 * rng.standard_normal((NUM_HEADS, HEAD_DIM))).astype(np.float32)
        self.device = [cuda.to_device(a) for a in (self.q, swizzle_rows(self.k_pages), swizzle_rows(self.v_pages),
                                                   self.page_table, np.array([context - 1], np.int32))]
        self.out = cuda.to_device(np.full(NUM_HEADS * HEAD_DIM, np.nan, np.float16))

    def expected(self):
        return reference_attention(self.q, self.k_pages, self.v_pages, self.page_table, self.context)

    def check(self):
        # float16 output: 2e-3 is four half-ULPs at 1.0; the float32 math inside is far finer.
        np.testing.assert_allclose(self.out.copy_to_host().astype(np.float64), self.expected(),
                                   rtol=2e-3, atol=2e-3, err_msg=f"context {self.context}")


@pytest.fixture(scope="module")
def attention():
    return make_decode_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES)


@pytest.mark.parametrize("context", [1, 15, 16, 17, 512, 4096, 32768])
def test_decode_attention_7b_matches_reference(attention, context):
    case = Case(np.random.default_rng(context), context)
    stream = cuda.stream()
    attention.launch(stream, *case.device, case.out)
    stream.synchronize()
    case.check()


def time_in_graph(attention, case, stream, launches=200):
    """Seconds per call: `launches` calls captured in one graph, replayed, timed with events."""
    attention.launch(stream, *case.device, case.out)  # compiled before capture
    graph = capture(stream, lambda: [attention.launch(stream, *case.device, case.out)
                                     for _ in range(launches)])
    try:
        graph.launch(stream)  # warm: first replay uploads the graph
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3 / launches
    finally:
        stream.synchronize()
        graph.close()


def test_decode_attention_7b_speed_in_graph(attention):
    """Prints us per call and K/V GB/s; asserts the replayed graph still computes the right thing
    (the split counter must reset itself at every replay)."""
    stream = cuda.stream()
    for context in (512, 4096, 32768):
        case = Case(np.random.default_rng(7 + context), context)
        seconds = time_in_graph(attention, case, stream)
        kv_bytes = 2 * context * NUM_KV_HEADS * HEAD_DIM * 2
        print(f"\ndecode attention 7B ctx {context:6d}: {seconds * 1e6:7.2f} us/call, "
              f"K+V {kv_bytes / 2**20:5.1f} MiB -> {kv_bytes / seconds / 1e9:7.1f} GB/s "
              f"({attention.num_splits} splits x {NUM_KV_HEADS} KV heads, {attention.stages} stages)")
        case.check()

