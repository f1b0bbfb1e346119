"""Batched prefill in the engine (CudaBackend.prefill, mode "batched") on the GPU (skipped elsewhere).

What it must give, on random models (pynanoqwen/synthetic.py):
1. 0.5B shapes (GQA 14/2, head_dim 64, tied FP16 lm_head), chunks of at most 64 rows so that
   prompts of 150 and 300 tokens cross chunk boundaries: the logits of the last prompt token
   against the numpy ReferenceModel (float32/float64), and against token-by-token prefill; the
   page table and allocator exactly as decode leaves them; no K/V slot written outside the prompt's
   positions (padding rows write nothing).
2. 7B shapes, the default 2048-row chunks: prompts of 1, 7, 64, 512, 2048 and 3000 (two chunks)
   tokens against token-by-token prefill (logits, page table, K/V of every position and layer);
   greedy decoding after batched prefill gives the tokens of decoding after token-by-token prefill
   wherever the logits leave no doubt; generate() uses the batched path and allocates nothing once
   its graphs exist; and the time to first token for a 512-token prompt (run with -s to see it).
3. The prefix cache, at both shapes (CudaBackend.generate_paged): a prompt that shares pages with
   an earlier one prefills only the rest, from a chunk that starts where the reused pages end; its
   K/V at every prompt position and its greedy tokens are bit for bit those of a cold run of the
   same prompt, although the two compute the new rows in chunks of other lengths and starts,
   through other wgmma tiles and forms (sequential, or split by K chunks). That equality is what
   lets the engine report full prompt pages as reusable (prefix_cache.PagedBackend): every bucket
   sums a row alike (gemm_int4_tiles.rows_sum_alike). mma.sync's SMALL tile, which served chunks
   of up to 16 rows before, rounds otherwise (measured: a 9-row warm chunk gave other K/V bits from
   its first position), so no 7B chunk runs on it now.

Error bounds (u16 = 2^-11), relative L2 of a logits row, derived by counting the FP16 roundings one
decoder layer puts on its update, as tests/test_engine_gpu.py does for decode (8 per layer there):
- batched prefill: xn before QKV and before gate-up, the dequantized weights (w s rounded once,
  kernels/gemm_int4.py), q, K and V (the attention's operands), the softmax weights P (FP16 into
  the P V mma, kernels/attention_prefill.py), attn, the MLP product: 9 roundings, plus 1 for the
  FP32 accumulations, rsqrt and ex2.approx together (each orders of magnitude below u16 at these
  sizes): 10 u16 per layer, so num_layers * 10 u16 against the float64-exact model;
- against token-by-token prefill, both paths err against that same model: (8 + 10) u16 per layer.
  The K/V of layer l carry the drift of the l layers below and their own QKV: (l + 1) * 18 u16.
These are worst-case sums of per-layer bounds; the measured errors print next to them.

Environment: PYNANOQWEN_7B_FILE, a prebuilt 7B .nanoqwen (otherwise random 7B weights are made in
memory, seed 0).
"""

import os
import statistics
import time

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.config import PRESETS
from pynanoqwen.engine import CudaBackend
from pynanoqwen.kernels.kv_layout import swizzle_rows
from pynanoqwen.kernels.page_alloc import PAGE_SIZE
from pynanoqwen.prefix_cache import PrefixCache
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.synthetic import SyntheticWeights

pytestmark = pytest.mark.gpu

U16 = 2.0 ** -11
DECODE_LAYER_BOUND = 8 * U16  # tests/test_engine_gpu.py's per-layer bound of the decode path
PREFILL_LAYER_BOUND = 10 * U16
SENTINEL_BYTE = 0x7E  # every FP16 of the pool becomes 0x7E7E, a NaN no kernel writes


def rel_l2(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - theirs) / np.linalg.norm(theirs))


def prefill_state(backend, ids, mode: str) -> dict:
    """Reset to `ids`, prefill them in `mode` (greedy), and read back what decode continues from."""
    n, s = len(ids), backend.stream
    backend.reset(ids, SamplingParams())
    backend.prefill(n, "argmax", mode=mode)
    state = {name: array.copy_to_host(stream=s) for name, array in
             (("logits", backend.act.logits), ("pos", backend.state.pos),
              ("next_free_page", backend.state.next_free_page), ("page_table", backend.state.page_table),
              ("tokens", backend.state.tokens))}
    s.synchronize()
    state["page_table"] = state["page_table"][:-(-n // PAGE_SIZE)]
    state["token"] = int(state["tokens"][n])
    return state


def kv_of_positions(backend, n: int, page_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V [layers, n, kv_heads, head_dim] of positions 0..n-1, gathered from the pages."""
    positions = np.arange(n)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k, v = swizzle_rows(backend.kv.k.copy_to_host()), swizzle_rows(backend.kv.v.copy_to_host())
    return (np.moveaxis(k[:, pages, :, slots], 0, 1).astype(np.float32),
            np.moveaxis(v[:, pages, :, slots], 0, 1).astype(np.float32))


def check_against_decode(backend, ids) -> dict:
    """Batched against token-by-token prefill of the same prompt: logits, tables, K/V."""
    layers, n = backend.config.num_layers, len(ids)
    decode = prefill_state(backend, ids, "decode")
    k_decode, v_decode = kv_of_positions(backend, n, decode["page_table"])
    batched = prefill_state(backend, ids, "batched")
    k_batched, v_batched = kv_of_positions(backend, n, batched["page_table"])
    assert batched["pos"][0] == decode["pos"][0] == n
    assert batched["next_free_page"][0] == decode["next_free_page"][0] == -(-n // PAGE_SIZE)
    np.testing.assert_array_equal(batched["page_table"], decode["page_table"])
    assert batched["token"] == int(np.argmax(batched["logits"])), "the sampled token is not the logits' argmax"
    kv_errors = [max(rel_l2(k_batched[layer], k_decode[layer]), rel_l2(v_batched[layer], v_decode[layer]))
                 for layer in range(layers)]
    for layer, error in enumerate(kv_errors):
        assert error < (layer + 1) * (DECODE_LAYER_BOUND + PREFILL_LAYER_BOUND), (layer, error)
    logits_error = rel_l2(batched["logits"], decode["logits"])
    assert logits_error < layers * (DECODE_LAYER_BOUND + PREFILL_LAYER_BOUND)
    top2 = np.sort(decode["logits"])[-2:]
    clear = top2[1] - top2[0] > 2 * np.abs(batched["logits"] - decode["logits"]).max()
    if clear:  # no error of the measured size can change the winner
        assert batched["token"] == decode["token"]
    return {"tokens": n, "logits_rel_l2": logits_error, "kv_rel_l2_first_last_layer": (kv_errors[0], kv_errors[-1]),
            "same_first_token": batched["token"] == decode["token"], "clear_winner": bool(clear)}


# ================================================================================================
# 1. 0.5B shapes, 64-row chunks, against the numpy reference model

SMALL = PRESETS["0.5b"]
SMALL_CHUNK = 64


@pytest.fixture(scope="module")
def backend_small():
    backend = CudaBackend(SyntheticWeights(SMALL, seed=1), max_context=512, prefill_rows=SMALL_CHUNK)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference_small():
    return ReferenceModel(SyntheticWeights(SMALL, seed=1), max_context=512)


@pytest.mark.parametrize("tokens", [1, 7, 64, 150, 300])
def test_batched_prefill_matches_the_reference_model(backend_small, reference_small, tokens):
    ids = np.random.default_rng().integers(0, SMALL.vocab_size, tokens)
    ours = prefill_state(backend_small, ids, "batched")["logits"]
    reference_small.reset()
    theirs = reference_small.forward(ids, last_only=True)[0]
    error = rel_l2(ours, theirs)
    print(f"\n0.5b, {tokens} tokens in chunks of {SMALL_CHUNK}: logits rel L2 {error:.2e} against the reference "
          f"(bound {SMALL.num_layers * PREFILL_LAYER_BOUND:.2e})")
    assert error < SMALL.num_layers * PREFILL_LAYER_BOUND


@pytest.mark.parametrize("tokens", [7, 150])
def test_batched_prefill_matches_token_by_token_prefill_small(backend_small, tokens):
    result = check_against_decode(backend_small, np.random.default_rng().integers(0, SMALL.vocab_size, tokens))
    print(f"\n0.5b: {result}")


def test_padding_rows_write_no_kv_slot(backend_small):
    """150 tokens in chunks of 64, 64 and 22 (a 32-row bucket: rows 22..31 are padding at
    positions 150..159, inside the last page): every slot but positions 0..149 keeps its bytes."""
    from numba.cuda.cudadrv.driver import device_memset

    n = 150
    ids = np.random.default_rng().integers(0, SMALL.vocab_size, n)
    backend = backend_small
    try:
        for pool in (backend.kv.k, backend.kv.v):
            device_memset(pool, SENTINEL_BYTE, pool.nbytes, stream=backend.stream)
        table = prefill_state(backend, ids, "batched")["page_table"]
        written = np.zeros(backend.kv.k.shape[1:4], bool)  # [pages, kv_heads, slots]
        positions = np.arange(n)
        written[table[positions // PAGE_SIZE], :, positions % PAGE_SIZE] = True
        sentinel = np.uint16(SENTINEL_BYTE * 0x101)
        for pool in (backend.kv.k, backend.kv.v):
            bits = pool.copy_to_host().view(np.uint16)
            assert (bits[:, ~written] == sentinel).all(), "a slot outside the prompt was written"
            assert (bits[:, written] != sentinel).all(), "a prompt position was not written"
    finally:  # leave the pool as the engine keeps it: no NaN bit patterns
        for pool in (backend.kv.k, backend.kv.v):
            device_memset(pool, 0, pool.nbytes, stream=backend.stream)
        backend.stream.synchronize()


# ================================================================================================
# 2. 7B shapes, 2048-row chunks

SEVEN_B = PRESETS["7b"]


@pytest.fixture(scope="module")
def backend_7b():
    model = os.environ.get("PYNANOQWEN_7B_FILE") or SyntheticWeights(SEVEN_B, seed=0)
    backend = CudaBackend(model, max_context=4096)
    yield backend
    backend.close()


@pytest.mark.slow
def test_batched_prefill_matches_token_by_token_prefill_7b(backend_7b):
    assert backend_7b.prefill_mode == "batched" and backend_7b.prefill_buckets[-1] == 2048
    rng = np.random.default_rng()
    for tokens in (1, 7, 64, 512, 2048, 3000):
        result = check_against_decode(backend_7b, rng.integers(0, SEVEN_B.vocab_size, tokens))
        print(f"\n7b: {result} (logits bound {SEVEN_B.num_layers * (DECODE_LAYER_BOUND + PREFILL_LAYER_BOUND):.2e})")


def greedy_after_prefill(backend, ids, new_tokens: int, mode: str) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens after prefilling `ids` in `mode`, and the logits each was drawn from."""
    n, s = len(ids), backend.stream
    backend.reset(ids, SamplingParams())
    backend.prefill(n, "argmax", mode=mode)
    logits = [backend.act.logits.copy_to_host(stream=s)]
    for position in range(n, n + new_tokens - 1):
        backend.step(position, "argmax")
        logits.append(backend.act.logits.copy_to_host(stream=s))
    tokens = backend.state.tokens.copy_to_host(stream=s)
    s.synchronize()
    return [int(t) for t in tokens[n:n + new_tokens]], logits  # tokens[n + j] comes from logits[j]


@pytest.mark.slow
def test_greedy_tokens_after_batched_prefill_match_token_by_token_7b(backend_7b):
    rng = np.random.default_rng()
    new_tokens, compared, results = 16, 0, []
    for tokens in (5, 37, 300):
        ids = rng.integers(0, SEVEN_B.vocab_size, tokens)
        reference, reference_logits = greedy_after_prefill(backend_7b, ids, new_tokens, "decode")
        ours, our_logits = greedy_after_prefill(backend_7b, ids, new_tokens, "batched")
        # generate() runs the batched path by default and yields the same tokens.
        assert list(backend_7b.generate(ids.tolist(), SamplingParams(), new_tokens, frozenset())) == ours
        agreed = 0
        for step, (a, b) in enumerate(zip(reference_logits, our_logits)):
            top2 = np.sort(a)[-2:]
            if top2[1] - top2[0] <= 2 * np.abs(a - b).max():
                break  # a near tie: the sequences may part here, and legitimately
            assert ours[step] == reference[step], (tokens, step)
            agreed += 1
        compared += agreed
        results.append((tokens, agreed, ours == reference))
    print(f"\n7b greedy, {new_tokens} tokens after prefill: (prompt tokens, steps compared, identical) {results}")
    assert compared > 0, "every prompt hit a near tie at once: nothing was compared"


@pytest.mark.slow
def test_batched_prefill_allocates_no_device_memory_7b(backend_7b):
    from numba.cuda.cudadrv import driver

    ids = list(range(1, 101))
    list(backend_7b.generate(ids, SamplingParams(), 2, frozenset()))  # compiles and captures the 128-row graph
    calls, original = [], driver.Context.memalloc

    def counting(self, size):
        calls.append(size)
        return original(self, size)

    cuda.synchronize()
    free_before, _ = cuda.current_context().get_memory_info()
    driver.Context.memalloc = counting
    try:
        list(backend_7b.generate(ids[::-1], SamplingParams(), 2, frozenset()))
        cuda.synchronize()
    finally:
        driver.Context.memalloc = original
    free_after, _ = cuda.current_context().get_memory_info()
    assert calls == [] and free_after == free_before


def time_to_first_token(backend, ids, repeats: int = 5) -> float:
    """Median ms from calling generate() to holding its first token, after one warm-up."""
    def once() -> float:
        start = time.perf_counter()
        next(iter(backend.generate(ids, SamplingParams(), 1, frozenset())))
        return 1e3 * (time.perf_counter() - start)

    once()
    return statistics.median(once() for _ in range(repeats))


@pytest.mark.slow
def test_time_to_first_token_512_7b(backend_7b):
    ids = np.random.default_rng().integers(0, SEVEN_B.vocab_size, 512).tolist()
    batched = time_to_first_token(backend_7b, ids)
    backend_7b.prefill_mode = "decode"
    try:
        by_token = time_to_first_token(backend_7b, ids)
    finally:
        backend_7b.prefill_mode = "batched"
    print(f"\n7b TTFT at 512 prompt tokens, median of 5: batched prefill {batched:.1f} ms, "
          f"token by token {by_token:.1f} ms")
    assert batched < by_token


# 3. The prefix cache

def warm_against_cold(backend, ids_a: list[int], ids_b: list[int], new_tokens: int = 4) -> dict:
    """Prompt a, then prompt b in a prefix cache's lease (reusing a's pages where they match),
    against b run cold: K/V of b's prompt positions, greedy tokens, and the pages b ran in."""
    cache = PrefixCache.for_backend(backend)
    greedy, s = SamplingParams(), backend.stream
    lease_a = cache.lease(ids_a, len(ids_a) + new_tokens)
    tokens_a = list(backend.generate_paged(ids_a, greedy, new_tokens, frozenset(), lease_a))
    cache.commit(lease_a, ids_a + tokens_a)
    lease_b = cache.lease(ids_b, len(ids_b) + new_tokens)
    warm = list(backend.generate_paged(ids_b, greedy, new_tokens, frozenset(), lease_b))
    table = backend.state.page_table.copy_to_host(stream=s)
    s.synchronize()
    pages_b = -(-(len(ids_b) + new_tokens - 1) // PAGE_SIZE)
    assert table[:pages_b].tolist() == lease_b.page_table()[:pages_b], "the lease's pages were not the ones used"
    k_warm, v_warm = kv_of_positions(backend, len(ids_b), table)
    cold = list(backend.generate(ids_b, greedy, new_tokens, frozenset()))
    cold_table = backend.state.page_table.copy_to_host(stream=s)
    s.synchronize()
    k_cold, v_cold = kv_of_positions(backend, len(ids_b), cold_table)
    differ = np.flatnonzero((k_warm != k_cold).any(axis=(0, 2, 3)) | (v_warm != v_cold).any(axis=(0, 2, 3)))
    return {"prompt_b": len(ids_b), "cached": lease_b.cached_tokens, "reused_pages": lease_b.reused,
            "kv_identical": not differ.size, "first_differing_position": int(differ[0]) if differ.size else None,
            "tokens_identical": warm == cold, "warm": warm, "cold": cold}


def shared_prefix_prompts(rng, vocab: int, shared: int, len_a: int, len_b: int) -> tuple[list[int], list[int]]:
    """Two random prompts whose first `shared` tokens are equal and whose next token differs."""
    a = rng.integers(0, vocab, len_a).tolist()
    b = a[:shared] + rng.integers(0, vocab, len_b - shared).tolist()
    if len_b > shared and len_a > shared:
        b[shared] = (a[shared] + 1) % vocab
    return a, b


@pytest.mark.parametrize("shared, len_a, len_b", [
    (40, 45, 50),     # 32 reused: an 18-row chunk where the cold run has one of 50
    (100, 130, 105),  # 80 reused (not 96: 9 rows would run on mma.sync): 25 rows against 64 + 41
    (300, 400, 310),  # 288 reused: 22 rows against 4 x 64 + 54 cold
    (64, 64, 200),    # b extends a: its 4 pages reused, chunks of 64, 32, 40 against 64, 64, 32, 40
    (150, 150, 197),  # 144 reused: 53 rows against 64, 64, 32, 37 cold (a last 5 would be mma.sync)
    (138, 138, 198),  # a ran as 64, 32, 42; 128 reused: 32, 38 against 64, 64, 32, 38
])
def test_a_reused_prefix_gives_the_kv_and_tokens_of_a_cold_run_small(backend_small, shared, len_a, len_b):
    rng = np.random.default_rng()
    a, b = shared_prefix_prompts(rng, SMALL.vocab_size, shared, len_a, len_b)
    result = warm_against_cold(backend_small, a, b)
    print(f"\nprefix cache, 0.5b: {result}")
    # Pages wholly inside the shared tokens and a's prompt, leaving b its min_prefill tokens to run.
    assert result["cached"] == min(shared, len_a, len_b - backend_small.min_prefill) // PAGE_SIZE * PAGE_SIZE > 0
    assert result["kv_identical"], result["first_differing_position"]
    assert result["tokens_identical"]


@pytest.mark.slow
def test_a_reused_prefix_gives_the_kv_and_tokens_of_a_cold_run_7b(backend_7b):
    """3000 tokens, then 2990 of them and 20 more: 2976 reused, a 34-row chunk at 2976 (WG1_T64),
    against chunks of 2048 and 962 rows cold (WG1_T128, WG2_T128 and TMA_T256)."""
    rng = np.random.default_rng()
    a, b = shared_prefix_prompts(rng, SEVEN_B.vocab_size, 2990, 3000, 3010)
    result = warm_against_cold(backend_7b, a, b)
    print(f"\nprefix cache, 7b: {result}")
    assert result["cached"] == 2976
    assert result["kv_identical"], result["first_differing_position"]
    assert result["tokens_identical"]
