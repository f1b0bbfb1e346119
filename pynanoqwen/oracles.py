"""float64 oracles of the GPU kernels, the error bound each kernel's arithmetic puts on its output,
and the check results that validate and the self-check report.

Every oracle returns (expected, bound): the exact result in float64 from the inputs the kernel
was given, and a worst-case bound on |kernel output - expected|, elementwise, derived from the
kernel's roundings (each derivation is in the oracle's docstring). An output passes when every
error is within its bound (`bound_report`). A wrong kernel (a layout, fragment or unpack mistake)
is wrong by the size of the output itself, far beyond these bounds.

Unit roundoffs, one convention: u = 2^-p for a format of p significant bits (the implicit one
included), the largest relative error of one round-to-nearest: U16 = 2^-11 (float16), U32 = 2^-24
(float32). A float16 store of a value below the normal range errs by at most FP16_TINY absolute.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .kernels import kernel_path
from .kernels.gemm_int4_tiles import K_CHUNKS
from .quant import dequantize_int4

U16, U32 = 2.0**-11, 2.0**-24
FP16_TINY = 2.0**-25  # half the spacing of float16 subnormals
GEMV_ROW_BLOCK = 4096  # weight rows dequantized at once (an lm_head has 152k)


@dataclasses.dataclass(frozen=True)
class Check:
    status: str  # "PASS", "FAIL" or "SKIP"
    tier: str
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.tier:<9} {self.name:<34} {self.detail}"


def passed(name: str, ok: bool, detail: str) -> Check:
    """A check of the current tier (validate's runner fills in the tier)."""
    return Check("PASS" if ok else "FAIL", "", name, detail)


def skipped(name: str, reason: str) -> Check:
    return Check("SKIP", "", name, reason)


def bound_report(name: str, error: np.ndarray, bound: np.ndarray) -> Check:
    """PASS when every |error| is within its bound; the detail gives the worst error/bound ratio.
    A NaN error (a kernel that read an uninitialised slot) fails."""
    error = np.where(np.isnan(error), np.inf, np.asarray(error, np.float64))
    ratio = error / np.maximum(np.asarray(bound, np.float64), np.finfo(np.float64).tiny)
    worst = int(np.argmax(ratio))
    ok = bool(np.all(error <= np.asarray(bound)))
    return passed(name, ok, f"{ratio.size} outputs, worst error {ratio.flat[worst]:.2f} of its bound"
                            + ("" if ok else f" at output {worst}"))


# ----------------------------------------------------------------------------------------------
# Linears

def activation_scales(path: str, largest: np.ndarray) -> np.ndarray:
    """The float32 scale of each group of a GEMV path that rounds x to integers, from the group's
    largest |x|, as the kernel computes it: dp4a max / 127 (kernels/quantize_activation.py), fixed16
    max * float32(1 / 32767) (kernels/gemv_int4_paths.py)."""
    largest = largest.astype(np.float32)
    return largest / np.float32(127) if path == "dp4a" else largest * np.float32(1.0 / 32767)


# The GEMV paths that round x to integers, and how many inputs share a scale.
INTEGER_ACTIVATIONS = {"dp4a": 128, "fixed16": 32}


def gemv_oracle(qweight, scales, x: np.ndarray, path: str,
                input_error: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W x, bound on |GEMV(x) - W x|) for the INT4 GEMV on `path` (kernels/gemv_int4.py), W the
    dequantized INT4 weight (some of its rows, as given).

    float32: per chunk a lane rounds three times (FP16 halves to float32 sum, scale, accumulate),
    over at most S = ceil(K/1024) chunks; then 5 warp_sum steps, the partial sums of the at most S
    warps that share a tile (gemv_int4_kernel.py, work split), the epilogue: at most 4 S + 6 <=
    K/32 + 8 roundings (K >= 128) of u32 times sum |w x|. prmt: each FP16 half-accumulator rounds 16
    times by at most u16 of the partial sum. dp4a: the integer dot is exact; x is rounded to INT8
    per 128-input group (|error| <= scale/2 + 2^-22 |x|, scale = max |x| / 127 over the group).
    fixed16: the same with 16-bit integers per 32-input chunk (scale = max |x| / 32767 over the
    chunk, activation_scales; kernels/gemv_int4_paths.py derives the bound).
    input_error: the GEMV reads a copy of x that may be off by up to this, elementwise (a fused
    RMSNorm's FP16 output); the bound grows by |W| input_error. path may be "auto": the bound is
    that of the path a GEMV of this K runs (kernels.kernel_path).
    """
    k = x.shape[0]
    path = kernel_path(path, k)
    x64 = x.astype(np.float64)
    if path in INTEGER_ACTIVATIONS:
        group = INTEGER_ACTIVATIONS[path]
        # The GEMV scales the x it reads, which may be larger than x by input_error.
        reach = np.abs(x64) if input_error is None else np.abs(x64) + input_error
        scale = activation_scales(path, reach.reshape(-1, group).max(axis=1))
        rounding = np.repeat(scale.astype(np.float64), group) / 2 + 2.0**-22 * np.abs(x64)
    else:
        rounding = np.zeros(k)
    if input_error is not None:
        rounding = rounding + input_error
    expected, bound = np.empty(len(qweight)), np.empty(len(qweight))
    for first in range(0, len(qweight), GEMV_ROW_BLOCK):
        rows = slice(first, first + GEMV_ROW_BLOCK)
        w = dequantize_int4(qweight[rows], scales[rows], np.float64)
        magnitude = np.abs(w) @ (np.abs(x64) + rounding)
        expected[rows] = w @ x64
        bound[rows] = (k // 32 + 8) * U32 * magnitude + np.abs(w) @ rounding
        if path == "prmt":
            bound[rows] += 16 * U16 * magnitude
    return expected, bound


def fp16_gemv_oracle(weight: np.ndarray, x: np.ndarray,
                     input_error: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W x, bound) for the FP16 GEMV (kernels/gemv_fp16.py) over rows of an FP16 table: FP16 x
    FP16 products are exact in float32, and only the sums round (as in gemv_oracle)."""
    x64 = x.astype(np.float64)
    expected, bound = np.empty(len(weight)), np.empty(len(weight))
    for first in range(0, len(weight), GEMV_ROW_BLOCK):
        w = np.asarray(weight[first:first + GEMV_ROW_BLOCK], np.float64)
        rows = slice(first, first + len(w))
        expected[rows] = w @ x64
        bound[rows] = (x.shape[0] // 32 + 8) * U32 * (np.abs(w) @ np.abs(x64))
        if input_error is not None:
            bound[rows] += np.abs(w) @ input_error
    return expected, bound


def gemm_oracle(qweight, scales, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X W^T [m, rows], bound) for the tensor-core INT4 GEMM (kernels/gemm_int4.py, either kernel)
    on FP16 activations X [m, K] and some rows of W.

    mag = |X| |W|^T. The kernel rounds each weight (u - 8) s to FP16 once: u16 mag. Each mma adds
    16 exact FP16 products to its FP32 accumulator; the tensor core aligns the 17 addends to the
    largest, truncates to >= 24 bits and normalises once (Fasi, Higham, Mikaitis, Pranesh,
    "Numerical behavior of NVIDIA tensor cores", 2021): <= 36 u32 (|c| + sum |p|) per step, and
    over K/16 steps, with every |c| <= 1.01 mag, at most 37 (K/16 + 1) u32 mag. The wgmma kernel
    sums K in up to K_CHUNKS chunks (kernels/gemm_int4_wgmma.py, "K chunks"), whose float32 adds
    round K_CHUNKS - 1 more times, each at most u32 of a partial sum <= 1.01 mag: K_CHUNKS u32 mag.
    """
    w = dequantize_int4(qweight, scales, np.float64)
    x64 = np.asarray(x, np.float64)
    magnitude = np.abs(x64) @ np.abs(w).T
    return x64 @ w.T, (U16 + (37 * (x.shape[1] // 16 + 1) + K_CHUNKS) * U32) * magnitude


def silu_product_oracle(g: np.ndarray, g_bound: np.ndarray, u: np.ndarray,
                        u_bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(silu(g) u, bound) of the gate-up epilogues, given the exact gate and up projections and the
    bounds on the kernel's g and u: silu's slope is within [-0.1, 1.1], so g's error moves silu(g)
    by at most 1.1 g_bound; float32 exp, divide and multiply are a few u32 of the result; the
    FP16 store one u16 (or FP16_TINY below the normal range)."""
    silu = g / (1 + np.exp(-g))
    expected = silu * u
    bound = ((U16 + 8 * U32) * np.abs(expected) + FP16_TINY + 1.1 * np.abs(u) * g_bound
             + (np.abs(silu) + 1.1 * g_bound) * u_bound)
    return expected, bound


def gemm_epilogue_oracle(weights, x: np.ndarray, epilogue: str, start: np.ndarray | None = None,
                         bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out, bound) of a whole INT4 GEMM call with one of gemm_int4's epilogues: weights one
    (qweight, scales) per matrix (gate, then up for gate_up_silu), start the out it adds to
    (residual), bias float16 [N] (bias). The epilogue's one float32 add (bias or residual) after
    the GEMM: one u32 of the result more."""
    products = [gemm_oracle(qweight, scales, x) for qweight, scales in weights]
    if epilogue == "gate_up_silu":
        return silu_product_oracle(*products[0], *products[1])
    expected, bound = products[0]
    expected = expected + (start if epilogue == "residual" else 0) + (0 if bias is None else bias)
    return expected, bound + U32 * np.abs(expected)


# ----------------------------------------------------------------------------------------------
# Row kernels

def rmsnorm_oracle(h: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(RMSNorm(h) * weight over the last axis, bound) of the FP16 output of kernels/rmsnorm.py (and
    of the GEMVs that normalise their own input, with the same float32 expression): one FP16
    rounding, plus float32 arithmetic (a sum of K squares, rsqrt, two products): 128 u32."""
    h64 = np.asarray(h, np.float64)
    xn = h64 / np.sqrt(np.mean(h64 * h64, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    return xn, (U16 + 128 * U32) * np.abs(xn) + FP16_TINY


def rope_oracle(qkv: np.ndarray, positions: np.ndarray, heads: int, kv_heads: int, head_dim: int,
                theta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parts, rotated, bound) of kernels/rope_kv_write.py for float32 qkv rows [n, (heads + 2
    kv_heads) head_dim] at `positions` [n]: parts [n, heads + 2 kv_heads, head_dim] the q, k, v
    heads as given, rotated the same with q and k rotated (HF's rotate_half), bound on the float32
    rotation of every head: cos and sin are float32 tables (one rounding each), two products and a
    sum in float32, so |x1| + |x2| times 16 u32 bounds each output. The K slot stores FP16: add
    U16 |k| + FP16_TINY there; the V slot must be float16(v) exactly.
    """
    n = len(positions)
    parts = np.asarray(qkv, np.float64).reshape(n, heads + 2 * kv_heads, head_dim)
    angle = np.outer(positions, theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))[:, None]
    half = head_dim // 2
    x1, x2 = parts[..., :half], parts[..., half:]
    rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
    rotated[:, heads + kv_heads:] = parts[:, heads + kv_heads:]
    bound = 16 * U32 * np.concatenate([np.abs(x1) + np.abs(x2)] * 2, -1) + 1e-30
    return parts, rotated, bound


def attention_oracle(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_positions: np.ndarray, *,
                     fp16_operands: bool) -> tuple[np.ndarray, np.ndarray]:
    """(causal softmax attention, bound) of q [rows, heads, d] (float32, unscaled) at
    query_positions [rows] over the cache keys, values [positions, kv_heads, d] (float16), query
    head h reading KV head h // (heads / kv_heads). Returns [rows, heads * d].

    Both attention kernels work in the log2 domain: q scaled by log2(e) / sqrt(d), weights by
    exp2 (ex2, relative error ~2^-22 each). The prefill kernel (fp16_operands) feeds the tensor
    cores fp16(scaled q), so the oracle takes q at that precision, and rounds the weights P to
    FP16 before P V: 2^-11 of sum_j w_j |v_j|. Float32:
    scores over d products and the scaling of q, off by at most Delta = (d + 8) 2^-23
    max_j sum_d |q_d k_jd| in log2 units, which moves the normalised weights by a factor within
    2^(+-2 Delta); the score sums, the row sum and the accumulators over `count` keys, the
    rescalings (whose factor is shared by sum and accumulator, so only their roundings count) and
    the exp2s: (count + d + 4) 2^-23 of the same sum (the bound tests/test_attention_prefill_gpu.py
    derives), and the merge of the decode kernel's split partials, at most one per key: count
    2^-23 more. The decode kernel feeds the tensor cores q and the weights P each as an FP16 high
    part plus an FP16 remainder, within 2^-22 of their float32 values: 2 more 2^-23 of
    sum_d |q_d k_jd| in Delta, and 2^-22 of sum_j w_j |v_j|. The output is stored in FP16:
    u16 |out| + FP16_TINY.
    """
    rows, heads, d = q.shape
    kv_heads = keys.shape[1]
    scaled = np.asarray(q, np.float32) * np.float32(math.log2(math.e) / math.sqrt(d))
    q64 = (scaled.astype(np.float16) if fp16_operands else scaled).astype(np.float64)
    keys, values = np.asarray(keys, np.float64), np.asarray(values, np.float64)
    visible = np.arange(len(keys))[None, :] <= np.asarray(query_positions)[:, None]  # [row, key]
    count = visible.sum(axis=1)
    expected, bound = np.empty((rows, heads, d)), np.empty((rows, heads, d))
    for head in range(heads):
        k, v = keys[:, head // (heads // kv_heads)], values[:, head // (heads // kv_heads)]
        scores = np.where(visible, q64[:, head] @ k.T, -np.inf)
        weights = np.exp2(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        expected[:, head] = weights @ v
        delta = (d + 10) * 2.0**-23 * np.where(visible, np.abs(q64[:, head]) @ np.abs(k).T, 0).max(axis=1)
        relative = ((U16 if fp16_operands else 2.0**-22) + (2 * count + d + 4) * 2.0**-23
                    + np.expm1(2 * math.log(2) * delta))
        bound[:, head] = (weights @ np.abs(v)) * relative[:, None] + U16 * np.abs(expected[:, head]) + FP16_TINY
    return expected.reshape(rows, -1), bound.reshape(rows, -1)
