"""dev/gemv_group_verify.py under the simulator: the verify GEMV of T tokens gives every token's row
bit for bit what dev/gemv_group.py's decode GEMV gives that token alone (a tile of one unit of one
row, or of two rows, whose lanes own the same groups), on fresh
random inputs: K of 4, 12 and 32 groups (so 28, 20 and no decode lanes without a group, whose zero
leaves the butterfly must still place), token counts from 1 to the mma's 16, weight pipelines 1 to
4 groups deep (slots that run into the next tile), 1 to 4 column tiles a warp, and warps that own
several tiles. Equality,
not a bound: lossless prompt lookup needs the same bits (docs/SPECULATIVE.md)."""

import numpy as np
import pytest
from numba import cuda

from gemv_group import GroupGemv
from gemv_group import Setting as DecodeSetting
from gemv_group_verify import GroupVerify, Setting, split_items
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.quant import quantize_int4

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

N = 32


def assert_verify_is_decode_alone(decode, verify, x, start):
    """decode.launch on each token m from out = start[m], verify.launch on all of them from start:
    the same bits."""
    alone = []
    for m in range(len(x)):
        out = cuda.to_device(start[m])
        decode.launch(0, cuda.to_device(x[m]), out)
        alone.append(out.copy_to_host())
    out = cuda.to_device(start)
    verify.launch(0, cuda.to_device(x), out)
    got = out.copy_to_host()
    assert np.array_equal(got, np.array(alone)), np.argwhere(got != np.array(alone))[:8]


def test_items_follow_the_butterfly():
    """Items: lanes 0, 16, 8, 24, ... (bit-reversed), those that own a group, each with its chain of
    groups L, L + 32, ...; with 4 splits split 1 holds leaves 8..15; padding items are not valid."""
    group, start, push, leaf, valid, counts = split_items(32, 1, 4)
    assert list(group[0, :8]) == [0, 16, 8, 24, 4, 20, 12, 28] and all(push[0]) and all(start[0])
    group, start, push, leaf, valid, counts = split_items(28, 1, 4)
    assert sorted(group[0]) == list(range(28)) and sum(push[0]) == 32  # 4 zero leaves after items
    group, start, push, leaf, valid, counts = split_items(36, 4, 4)
    assert list(group[1, :3]) == [2, 34, 18] and list(start[1, :3]) == [1, 0, 1] and list(push[1, :3]) == [0, 1, 1]
    assert list(leaf[1, :3]) == [0, 0, 1] and counts[1] == 12 and list(valid[1, 8:11]) == [1, 0, 0]


@pytest.mark.parametrize("k, tokens, warps, depth, columns, grid, unit_rows, norm", [
    (512, 1, 1, 4, 1, 1, 1, False),
    (512, 9, 2, 2, 2, 1, 2, True),
    (1536, 16, 1, 3, 2, 2, 1, False),
    (1536, 3, 2, 4, 1, 2, 2, True),
    (4096, 9, 1, 1, 4, 1, 1, False),
])
def test_verify_rows_are_the_decode_gemv_bits(k, tokens, warps, depth, columns, grid, unit_rows, norm):
    """norm: both read RMSNorm(h) * weight of float32 h, the decode GEMV in its blocks, the verify's
    staging kernel at the decode block's thread count (the sum of h^2 is in that order)."""
    rng = np.random.default_rng()
    qweight, scales = quantize_int4(rng.standard_normal((N, k)).astype(np.float32))
    x = (rng.standard_normal((tokens, k)) * np.repeat(rng.uniform(0.01, 4, (tokens, k // 128)), 128, 1))
    x = x.astype(np.float32 if norm else np.float16)
    weight, eps = ((1 + 0.3 * rng.standard_normal(k)).astype(np.float16), 1e-6) if norm else (None, None)
    h = rng.standard_normal((tokens, N)).astype(np.float32)
    decode = GroupGemv(N, k, qweight, scales, 2, DecodeSetting(rows=unit_rows, warps=1, blocks_per_sm=1, depth=2,
                                                               unit_rows=unit_rows), norm_weight=weight, norm_eps=eps)
    verify = GroupVerify(N, k, tokens, qweight, scales, grid, Setting(warps, depth, columns), decode_warps=1,
                         norm_weight=weight, norm_eps=eps)
    assert_verify_is_decode_alone(decode, verify, x, h)


@pytest.mark.parametrize("k, tokens, norm", [(512, 9, True), (1536, 16, False)])
def test_verify_gate_up_rows_are_the_decode_bits(k, tokens, norm):
    """The gate/up form (float16 silu(Wg x) * (Wu x)): gate and up in column tiles of their own, so a
    lane holds both of a (token, row) and applies the decode epilogue to the same two floats."""
    rng = np.random.default_rng()
    (gate_q, gate_s), (up_q, up_s) = (quantize_int4(rng.standard_normal((N, k)).astype(np.float32)) for _ in range(2))
    x = (0.1 * rng.standard_normal((tokens, k))).astype(np.float32 if norm else np.float16)
    weight, eps = ((0.1 * (1 + 0.3 * rng.standard_normal(k))).astype(np.float16), 1e-6) if norm else (None, None)
    decode = GroupGemv(N, k, gate_q, gate_s, 2, DecodeSetting(rows=1, warps=1, blocks_per_sm=1, depth=2),
                       norm_weight=weight, norm_eps=eps, up_q=up_q, up_s=up_s)
    verify = GroupVerify(N, k, tokens, gate_q, gate_s, 1, Setting(2, 2, 1), decode_warps=1, norm_weight=weight,
                         norm_eps=eps, up_q=up_q, up_s=up_s)
    assert_verify_is_decode_alone(decode, verify, x, np.zeros((tokens, N), np.float16))


@pytest.mark.parametrize("tokens, splits, depth", [(5, 1, 4), (9, 2, 2), (3, 4, 3), (16, 8, 1)])
def test_verify_with_chains_and_split_k(tokens, splits, depth):
    """K = 4608 (36 groups): decode lanes 0..3 sum two groups each, an FMA chain the verify must
    replay in order; with K split between 2 to 8 blocks, each a subtree of the butterfly that
    stages only its groups, and `combine` adding the subtree sums as warp_sum's top levels do."""
    rng = np.random.default_rng()
    k = 4608
    qweight, scales = quantize_int4(rng.standard_normal((N, k)).astype(np.float32))
    x = rng.standard_normal((tokens, k)).astype(np.float16)
    h = rng.standard_normal((tokens, N)).astype(np.float32)
    decode = GroupGemv(N, k, qweight, scales, 2, DecodeSetting(rows=1, warps=1, blocks_per_sm=1, depth=2))
    verify = GroupVerify(N, k, tokens, qweight, scales, 2 * splits, Setting(1, depth, 1, splits), decode_warps=1)
    assert_verify_is_decode_alone(decode, verify, x, h)


@pytest.mark.parametrize("tokens, position, norm", [(9, 27, False), (5, 14, True)])
def test_verify_qkv_rope_is_the_decode_bits(tokens, position, norm):
    """The QKV form: tokens at positions position + m (crossing a page boundary), q and every
    position's K and V slots bit for bit what gemv_group's RoPE form writes for each token alone
    (2 query heads, 1 KV head, head_dim 64, K 512)."""
    from pynanoqwen.kernels.rope_kv_write import rope_cos_sin

    rng = np.random.default_rng()
    heads, kv_heads, head_dim, k = 2, 1, 64, 512  # the pages' layout spans 64 dims (kernels/kv_layout.py)
    n = (heads + 2 * kv_heads) * head_dim
    qweight, scales = quantize_int4(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((tokens, k)).astype(np.float32 if norm else np.float16)
    weight, eps = ((1 + 0.3 * rng.standard_normal(k)).astype(np.float16), 1e-6) if norm else (None, None)
    bias = rng.standard_normal(n).astype(np.float16)
    cos, sin = (cuda.to_device(t) for t in rope_cos_sin(head_dim, 10000.0, 64))
    page_table = cuda.to_device(np.array([3, 1, 0, 2], np.int32))
    shape = (4, kv_heads, 16, head_dim)
    decode = GroupGemv(n, k, qweight, scales, 4, DecodeSetting(rows=2, warps=1, blocks_per_sm=1, depth=2,
                                                               unit_rows=2), norm_weight=weight, norm_eps=eps,
                       heads=(heads, kv_heads, head_dim), bias=bias)
    q_alone = cuda.to_device(np.full((tokens, heads * head_dim), np.nan, np.float32))
    k_alone, v_alone = (cuda.to_device(np.full(shape, np.nan, np.float16)) for _ in range(2))
    for m in range(tokens):
        decode.launch_rope(0, cuda.to_device(x[m]), q_alone[m], k_alone, v_alone, page_table,
                           cuda.to_device(np.array([position + m], np.int32)), cos, sin)
    verify = GroupVerify(n, k, tokens, qweight, scales, 2, Setting(1, 2, 1), decode_warps=1, norm_weight=weight,
                         norm_eps=eps, heads=(heads, kv_heads, head_dim), bias=bias)
    q = cuda.to_device(np.full((tokens, heads * head_dim), np.nan, np.float32))
    k_pages, v_pages = (cuda.to_device(np.full(shape, np.nan, np.float16)) for _ in range(2))
    verify.launch_rope(0, cuda.to_device(x), q, k_pages, v_pages, page_table,
                       cuda.to_device(np.array([position], np.int32)), cos, sin)
    for got, alone in ((q, q_alone), (k_pages, k_alone), (v_pages, v_alone)):
        got, alone = got.copy_to_host(), alone.copy_to_host()
        assert np.array_equal(got, alone, equal_nan=True)
        assert not np.isnan(got).all()
