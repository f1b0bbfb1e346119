"""Prefill attention on the GPU at Qwen2.5-7B shapes (28 query heads, 4 KV heads, head_dim 128)
against float64 causal softmax attention over the gathered cache, and its speed inside a CUDA graph.

One kernel object with M_cap = 2048 serves every (start, m), as in the engine's captured graph, so
short chunks also check that the blocks past m exit. Slots outside positions 0..start+m-1 and q
rows >= m hold NaN, and the page table is shuffled, as in tests/sim/test_attention_prefill_sim.py.

Tolerance, derived per output element (not tuned). The reference takes q at the precision the
kernel feeds the tensor cores, fp16(q * log2(e) / sqrt(d)), and K, V exactly (the cache is fp16).
The kernel then still rounds: the softmax weights to fp16 before P V (at most 2^-11 sum_j w_j |v_j|
on the output); float32 sums (scores over d products, row sums and O accumulators over the keys,
the rescalings: relative (keys + d + 4) 2^-23 of the same sum, and scores off by up to
Delta = d 2^-23 max_j sum_d |q_d k_jd| in log2 units, which moves the normalised weights by a
factor within 2^(+-2 Delta)); and the final fp16 store (2^-11 |out| + 2^-25 for subnormals).
ex2.approx's relative error (~2^-22) is inside the (keys + d + 4) 2^-23 term; the segment folds
add 6 x 2^-23 a segment (tests/attention_prefill_oracle.py).

Chunks of at most SPLIT_ROWS rows run split (a block per segment, then the merge): they must give
the bits the whole kernel gives for the same rows, which the prefix cache relies on.
"""

import numpy as np
import pytest
from numba import cuda

from attention_prefill_oracle import reference_and_bound
from pynanoqwen.gpu_timing import time_graph
from pynanoqwen.kernels.attention_prefill import PAGE_SIZE, SPLIT_ROWS, attention_flops, make_prefill_attention
from pynanoqwen.kernels.kv_layout import swizzle_rows

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128
MAX_PAGES = 32768 // PAGE_SIZE
POOL_PAGES = 560  # holds positions 0..8191 (512 pages) and some pages nothing points to
M_CAP = 2048


class Case:
    """Fresh random q and K/V pools for one (start, m), on the host and the device."""

    def __init__(self, rng, start, m):
        self.start, self.m = start, m
        shape = (POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
        self.k_pages = np.full(shape, np.nan, np.float16)
        self.v_pages = np.full(shape, np.nan, np.float16)
        # Every entry a valid pool page; the ones the chunk uses distinct and shuffled.
        self.page_table = rng.integers(0, POOL_PAGES, MAX_PAGES).astype(np.int32)
        used = -(-(start + m) // PAGE_SIZE)
        self.page_table[:used] = rng.permutation(POOL_PAGES)[:used]
        positions = np.arange(start + m)
        pages, slots = self.page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
        self.k_pages[pages, :, slots] = rng.standard_normal((start + m, NUM_KV_HEADS, HEAD_DIM))
        self.v_pages[pages, :, slots] = rng.standard_normal((start + m, NUM_KV_HEADS, HEAD_DIM))
        self.q = np.full((M_CAP, NUM_HEADS, HEAD_DIM), np.nan, np.float32)
        self.q[:m] = 3.0 * rng.standard_normal((m, NUM_HEADS, HEAD_DIM))  # peaked softmax
        self.device = [cuda.to_device(a) for a in (self.q, swizzle_rows(self.k_pages), swizzle_rows(self.v_pages),
                                                   self.page_table, np.array([start], np.int32),
                                                   np.array([m], np.int32))]
        self.out = cuda.to_device(np.full((M_CAP, NUM_HEADS * HEAD_DIM), np.nan, np.float16))

    def launch(self, attention, stream):
        attention.launch(stream, *self.device, self.out)

    def launch_rows(self, attention, stream, rows):
        """The same chunk in a bucket of `rows` rows (q's and out's first rows), as the engine runs it."""
        q, *rest = self.device
        attention.launch(stream, q[:rows], *rest, self.out[:rows])

    def check(self):
        expected, tolerance = reference_and_bound(self.q, self.k_pages, self.v_pages, self.page_table,
                                                  self.start, self.m)
        error = np.abs(self.out.copy_to_host()[:self.m].astype(np.float64) - expected)
        assert np.all(error <= tolerance), (f"start {self.start}, m {self.m}: max error {np.nanmax(error):.3g}, "
                                            f"{np.sum(~(error <= tolerance))} elements over their bound")
        return float(np.max(error / tolerance))


@pytest.fixture(scope="module", params=[16], ids=["query_tile16"])
def attention(request):
    return make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, query_tile=request.param)


@pytest.mark.parametrize("start, m", [(0, 1), (0, 64), (0, 512), (0, 2048), (2048, 2048), (6144, 2048)])
def test_prefill_attention_7b_matches_reference(attention, start, m):
    case = Case(np.random.default_rng(start * 4096 + m), start, m)
    stream = cuda.stream()
    case.launch(attention, stream)
    stream.synchronize()
    ratio = case.check()
    print(f"\nprefill attention 7B start {start:5d} m {m:5d} (query tile {attention.query_tile}): "
          f"max error / bound {ratio:.3f}")


def test_prefill_attention_7b_speed_in_graph(attention):
    """Prints us per call and TFLOP/s of the causal work; checks the replayed graph's result."""
    stream = cuda.stream()
    launches = 10
    for start, m in ((0, 512), (0, 2048), (2048, 2048)):
        case = Case(np.random.default_rng(7 + start + m), start, m)
        seconds = time_graph(stream, lambda: [case.launch(attention, stream) for _ in range(launches)]) / launches
        flops = attention_flops(start, m, NUM_HEADS, HEAD_DIM)
        print(f"\nprefill attention 7B start {start:5d} m {m:5d} (query tile {attention.query_tile}, M_cap {M_CAP}): "
              f"{seconds * 1e6:8.1f} us/call, {flops / 1e9:5.1f} GFLOP -> {flops / seconds / 1e12:6.1f} TFLOP/s")
        case.check()


def test_bench_prefill_attention_table_sums_the_engines_chunks():
    """bench_kernels.prefill_attention_table at 7B: a prompt of 2100 tokens is the engine's two
    chunks (2048, then 52 rows), its time is more than the 512-token prompt's, and no figure beats
    the tensor cores."""
    from pynanoqwen.bench_kernels import PEAK_TFLOPS, prefill_attention_table
    from pynanoqwen.config import PRESETS

    short, long = prefill_attention_table(PRESETS["7b"], (512, 2100), M_CAP)
    print(f"\nprefill attention 7B, one layer: 512 tokens {short['us_per_layer']:.1f} us "
          f"({short['tflops']:.0f} TFLOP/s), 2100 tokens {long['us_per_layer']:.1f} us ({long['tflops']:.0f})")
    assert (short["chunks"], long["chunks"]) == (1, 2)
    assert long["us_per_layer"] > short["us_per_layer"] > 0
    assert all(0 < row["tflops"] < PEAK_TFLOPS for row in (short, long))


@pytest.mark.parametrize("start, m, rows", [(3984, 22, 32), (0, 100, 128), (7000, 128, 128), (500, 9, 16)])
def test_split_chunks_give_the_whole_kernels_bits_7b(attention, start, m, rows):
    """A chunk in a bucket of <= SPLIT_ROWS rows (split) against the same rows in the 2048-row
    bucket (whole): identical bits, and within the float64 bound."""
    assert rows <= SPLIT_ROWS < M_CAP
    case = Case(np.random.default_rng(start + m), start, m)
    stream = cuda.stream()
    case.launch(attention, stream)
    whole = case.out.copy_to_host(stream=stream)[:m]
    case.out.copy_to_device(np.full((M_CAP, NUM_HEADS * HEAD_DIM), np.nan, np.float16), stream=stream)
    case.launch_rows(attention, stream, rows)
    stream.synchronize()
    ratio = case.check()
    split = case.out.copy_to_host()[:m]
    differ = int(np.sum(whole.view(np.uint16) != split.view(np.uint16)))
    print(f"\nprefill attention 7B start {start} m {m} in {rows} rows: split max error / bound {ratio:.3f}, "
          f"{differ} elements differ from the whole kernel's")
    assert differ == 0


def test_split_speed_on_a_cached_prefix_7b(attention):
    """Prints us per call of a 22-row chunk over 3984 cached keys (an /infill after one changed
    line) in the 32-row bucket: split, and the whole kernel on the same bucket."""
    whole_only = make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_PAGES, split_rows=0)
    case = Case(np.random.default_rng(5), 3984, 22)
    stream = cuda.stream()
    launches = 10
    times = {name: time_graph(stream, lambda a=a: [case.launch_rows(a, stream, 32) for _ in range(launches)])
             / launches for name, a in (("split", attention), ("whole", whole_only))}
    print(f"\nprefill attention 7B, 22 rows at 3984 in the 32-row bucket: split {times['split'] * 1e6:.1f} us, "
          f"whole {times['whole'] * 1e6:.1f} us a call")
    case.check()
