"""INT4 GEMV for one token: out[n] = sum_k W[n, k] x[k], plus a fused epilogue.

W is an INT4 linear in the ValueShuffle layout of pynanoqwen/quant.py: qweight uint32 [N, K/8]
(row n's K/8 words contiguous), scales float16 [N, K/128]. x is float16 [K]. At batch 1 every
weight byte is used once, so the kernel's job is to stream qweight at memory speed (~4.3 TB/s on
the H200) while doing as little arithmetic per weight as possible. Three paths read the same
layout: prmt (FP16 arithmetic), fixed16 (x as 16-bit integers, dp4a arithmetic) and dp4a (INT8
activations, a comparison path); the engine's "auto" takes fixed16, or prmt for a long K
(kernels.kernel_path), and `--gemv prmt|dp4a` forces one.

How the kernel is built: kernels/gemv_int4_kernel.py (the persistent grid and its work split, the
load pipeline, programmatic dependent launch, the RoPE epilogue) and kernels/gemv_int4_paths.py
(the paths' arithmetic, the activation staging, the fused RMSNorm). This module owns the plans (`GemvPlan`, `default_plan`), the
objects the engine launches and the compile targets.

Memory traffic per call (`gemv_bytes`): N*K/2 bytes of qweight + N*K/64 of scales + 2K of x.
At the H200's ~4.3 TB/s that is, for the 7B shapes: qkv 4608x3584 8.5 MB 2.0 us, o_proj 3584x3584
6.6 MB 1.5 us, gate+up 2 x 18944x3584 70.0 MB 16.3 us, down 3584x18944 35.0 MB 8.2 us, INT4
lm_head 152064x3584 281 MB 65 us; per decode step (28 layers + lm_head) 3.65 GB, 0.85 ms. What
each shape reaches, standalone and in the decode step: docs/PERFORMANCE.md.

API (the engine builds these once per layer, at load):

    gemv = make_gemv_int4(n, k, qweight, scales, path="prmt", bias=None, out_dtype="float32")
    gemv.launch(stream, x, out)                  # out[N] = W x (+ bias); x float16 [K]
    gemv.launch(stream, x, h, residual=True)     # h[N] += W x (o_proj, down_proj)
    mlp = make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, path="prmt")
    mlp.launch(stream, x, out)                   # out float16 [N] = silu(Wg x) * (Wu x)
    qkv = make_gemv_int4(..., norm_weight=w, norm_eps=eps)
    qkv.launch(stream, h, out)                   # x = RMSNorm(h) * w, h float32 [K]
    qkv = make_gemv_int4(..., rope_heads=(heads, kv_heads, head_dim))
    qkv.launch_rope(stream, h, q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin)

Weights and bias (float16 [N]) may be numpy arrays (copied to the device once) or device arrays
(used in place). Both factories take `plan=` (default: `default_plan(n, k, matrices)`). On the
dp4a path each object owns its INT8 workspace and `launch` runs two kernels, quantizer then GEMV.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda
from numba.core import types

from ..config import GROUP_SIZE
from ..device import sm_count
from ..launch import launch
from . import LONG_K, CompileTarget, kernel_path, on_device
from .gemv_int4_kernel import MAX_DEPTH, gemv_kernel
from .kv_layout import check_head_dim
from .quantize_activation import Int8Activations
from .rmsnorm import make_rmsnorm

PATHS = ("prmt", "fixed16", "dp4a")  # the kernel's arithmetic paths; "auto" picks one per shape (kernel_path)


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    """How a GEMV splits its work (gemv_int4_kernel.py, work split): R rows per tile, `depth` items
    in flight per lane, `warps` per block, at most `blocks_per_sm` blocks per SM (also the launch
    bound that caps registers at 65536 / (32 warps blocks_per_sm)); with split_tiles, warps take
    equal runs of items, tiles split between them, instead of whole tiles each."""

    rows: int = 1
    depth: int = 4
    warps: int = 8
    blocks_per_sm: int = 2
    split_tiles: bool = False

    def check(self, n: int) -> None:
        if self.rows not in (1, 2, 4) or n % self.rows:
            raise ValueError(f"rows={self.rows} must be 1, 2 or 4 and divide N={n}")
        if not 1 <= self.depth <= MAX_DEPTH or not 1 <= self.warps <= 32 or self.blocks_per_sm < 1:
            raise ValueError(f"{self}: depth 1..{MAX_DEPTH}, warps 1..32, blocks_per_sm >= 1")

    def grid(self, n: int, sm_count: int) -> int:
        """Blocks of the persistent grid. Split plans: blocks_per_sm on every SM (fewer when there
        are fewer tiles). Whole-tile plans: each warp computes `rounds` tiles (or one fewer), the
        fewest that blocks_per_sm blocks per SM allow, and the grid is as small as that leaves it,
        so no warp has a whole extra tile to do while others idle."""
        tiles = n // self.rows
        if self.split_tiles:
            return max(1, min(tiles, self.blocks_per_sm * sm_count))
        rounds = -(-tiles // (self.blocks_per_sm * sm_count * self.warps))
        return max(1, -(-(-(-tiles // rounds)) // self.warps))


ROPE_PLAN = GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2)  # QKV with RoPE: row pairs (d, d + head_dim/2)


def default_plan(n: int, k: int, matrices: int = 1) -> GemvPlan:
    """The plan the engine uses for an N x K linear (`matrices` 2 for gate/up), the fastest of
    dev/gemv_plans.py's sweep at each 7B shape (docs/PERFORMANCE.md): 4 items of 16 bytes in flight
    per lane and row. A long K (down_proj: 3584 rows of 19 items) splits tiles between warps, which
    whole tiles per warp left unbalanced (2 tiles on some warps, 1 on the rest), in one block of 16
    warps a SM rather than two of 8: 17.2 against 19.1 us a call. Every block stages all of x
    (37 KiB at K 18944), so half the blocks stage it half as often (the likely reason; not profiled)."""
    if matrices == 2:
        return GemvPlan(rows=1, depth=4, warps=8, blocks_per_sm=2)
    if k >= LONG_K:
        return GemvPlan(rows=2, depth=4, warps=16, blocks_per_sm=1, split_tiles=True)
    return GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2)


def _check(path: str, n: int, k: int, qweight, scales, plan: GemvPlan) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown GEMV path {path!r}; choose auto or one of {PATHS}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    if tuple(qweight.shape) != (n, k // 8) or tuple(scales.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not match "
                         f"N={n}, K={k}")
    plan.check(n)


class GemvInput:
    """What both GEMV objects share: the grid, the activations the kernel reads, and on the dp4a
    path the INT8 workspace.

    With a norm (weight float16 [K], eps) the input is the float32 residual stream h and the GEMV
    reads x = RMSNorm(h) * weight: the prmt and fixed16 kernels compute it while staging (one
    launch); the dp4a path runs kernels/rmsnorm.py into its own float16 workspace, then quantizes that.
    """

    def __init__(self, path: str, n: int, k: int, plan: GemvPlan, norm_weight=None, norm_eps=None):
        if (norm_weight is None) != (norm_eps is None):
            raise ValueError("norm_weight and norm_eps go together")
        self.path, self.n, self.k, self.plan = path, n, k, plan
        self.grid = plan.grid(n, sm_count())
        self.int8 = Int8Activations(k) if path == "dp4a" else None
        self.norm_eps = None if norm_eps is None else float(norm_eps)
        self.norm_weight = None if norm_weight is None else on_device(norm_weight, np.float16)
        if self.norm_weight is not None and tuple(self.norm_weight.shape) != (k,):
            raise ValueError(f"norm_weight must have shape ({k},), got {tuple(self.norm_weight.shape)}")
        if self.norm_weight is not None and path == "dp4a":
            self.rmsnorm = make_rmsnorm(k, self.norm_eps)
            self.xn = cuda.device_array(k, np.float16)

    @property
    def kernel_norm_eps(self):
        """The eps the kernel itself is built with: every path but dp4a fuses the norm."""
        return self.norm_eps if self.path != "dp4a" else None

    def activations(self, stream, x):
        """The kernel's `activations` tuple for x: float16 [K], or with a norm float32 h [K]
        (normalised first on dp4a); quantizes on dp4a."""
        dtype = np.float16 if self.norm_weight is None else np.float32
        if tuple(x.shape) != (self.k,) or x.dtype != dtype:
            raise ValueError(f"x must be {np.dtype(dtype)} [{self.k}], got {x.dtype} {tuple(x.shape)}")
        if self.norm_weight is not None:
            if self.int8 is None:
                return (x, self.norm_weight.view(np.uint32))
            self.rmsnorm.launch(stream, x, self.norm_weight, self.xn)
            x = self.xn
        x_pairs = x.view(np.uint32)
        if self.int8 is None:
            return (x_pairs,)
        self.int8.launch(stream, x_pairs)
        return (self.int8.xq, self.int8.scale, self.int8.offset)


class Int4Gemv:
    """out = W x (+ bias), or out += W x, for one INT4 linear; built by make_gemv_int4."""

    def __init__(self, n, k, qweight, scales, *, path="prmt", bias=None, out_dtype="float32",
                 plan=None, norm_weight=None, norm_eps=None, rope_heads=None):
        if rope_heads is not None:
            num_heads, num_kv_heads, head_dim = rope_heads
            plan = ROPE_PLAN if plan is None else plan
            if plan.rows != 2 or n != (num_heads + 2 * num_kv_heads) * head_dim or bias is None:
                raise ValueError(f"a QKV GEMV with RoPE needs rows=2 (got {plan.rows}), N = (heads + 2 kv heads) "
                                 f"x head_dim (got {n} for {rope_heads}) and a bias")
            check_head_dim(head_dim)  # it writes K/V pages (kernels/kv_layout.py)
        plan = default_plan(n, k) if plan is None else plan
        path = kernel_path(path, k)
        _check(path, n, k, qweight, scales, plan)
        if out_dtype not in ("float32", "float16"):
            raise ValueError(f"out_dtype must be 'float32' or 'float16', got {out_dtype!r}")
        self.rope_heads = None if rope_heads is None else tuple(rope_heads)
        self._input = GemvInput(path, n, k, plan, norm_weight, norm_eps)
        self.n, self.k, self.path, self.plan, self.out_dtype = n, k, path, plan, out_dtype
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.bias = None if bias is None else on_device(bias, np.float16)
        if self.bias is not None and tuple(self.bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(self.bias.shape)}")

    def kernel(self, residual: bool = False):
        """The compiled-on-first-use kernel this object launches."""
        if residual and self.out_dtype != "float32":
            raise ValueError("a residual GEMV accumulates into float32")
        if self.rope_heads is not None:
            return gemv_kernel(self.path, self.n, self.k, 1, self.plan, self._input.grid, "rope",
                               self._input.kernel_norm_eps, self.rope_heads)
        epilogue = "residual" if residual else "bias" if self.bias is not None else "store"
        return gemv_kernel(self.path, self.n, self.k, 1, self.plan, self._input.grid, epilogue,
                           self._input.kernel_norm_eps)

    def launch(self, stream, x, out, *, residual: bool = False) -> None:
        """out[N] = W x (+ bias), or out[N] += W x when residual; x float16 [K] on the device
        (with a norm: x float32 h [K], and the GEMV reads RMSNorm(h) * norm_weight)."""
        if self.rope_heads is not None:
            raise ValueError("this QKV GEMV applies RoPE: use launch_rope")
        kernel = self.kernel(residual)
        activations = self._input.activations(stream, x)
        bias = self.scales if self.bias is None else self.bias  # any float16 array when unused
        launch(kernel, self._input.grid, 32 * self.plan.warps, stream,
               (self.qweight, self.scales, self.qweight, self.scales, activations, bias, out))

    def launch_rope(self, stream, x, q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin) -> None:
        """The decode step's QKV projection (built with rope_heads): qkv = W x + bias for the token at
        position pos[0], then q float32 [num_heads, head_dim] = RoPE(q part), and that position's
        slot of k_pages (RoPE(k part)) and v_pages (v part), float16 [pages, kv heads, 16, head_dim],
        through page_table; rope_cos/rope_sin as kernels/rope_kv_write.rope_cos_sin."""
        activations = self._input.activations(stream, x)
        out = (q.reshape(q.size), k_pages, v_pages, page_table, pos, rope_cos, rope_sin)
        launch(self.kernel(), self._input.grid, 32 * self.plan.warps, stream,
               (self.qweight, self.scales, self.qweight, self.scales, activations, self.bias, out))


class GateUpSilu:
    """out = silu(Wg x) * (Wu x) in float16, gate and up read in one pass; built by make_gate_up_silu."""

    def __init__(self, n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", plan=None,
                 norm_weight=None, norm_eps=None):
        plan = default_plan(n, k, matrices=2) if plan is None else plan
        path = kernel_path(path, k)
        _check(path, n, k, gate_q, gate_s, plan)
        _check(path, n, k, up_q, up_s, plan)
        self._input = GemvInput(path, n, k, plan, norm_weight, norm_eps)
        self.n, self.k, self.path, self.plan = n, k, path, plan
        self.gate_q = on_device(gate_q, np.uint32).reshape(n * k // 8)
        self.gate_s = on_device(gate_s, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8)
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE)

    def kernel(self):
        return gemv_kernel(self.path, self.n, self.k, 2, self.plan, self._input.grid, "silu",
                           self._input.kernel_norm_eps)

    def launch(self, stream, x, out) -> None:
        """out float16 [N] = silu(Wg x) * (Wu x); x float16 [K] on the device (with a norm:
        float32 h [K], as Int4Gemv.launch)."""
        activations = self._input.activations(stream, x)
        launch(self.kernel(), self._input.grid, 32 * self.plan.warps, stream,
               (self.gate_q, self.gate_s, self.up_q, self.up_s, activations, self.gate_s, out))


def make_gemv_int4(n, k, qweight, scales, *, path="prmt", bias=None, out_dtype="float32",
                   plan=None, norm_weight=None, norm_eps=None, rope_heads=None) -> Int4Gemv:
    """An INT4 GEMV for W [n, k] (qweight uint32 [n, k/8], scales float16 [n, k/128]); with
    norm_weight (float16 [k]) and norm_eps it reads RMSNorm(h) * norm_weight of a float32 h; with
    rope_heads = (num_heads, num_kv_heads, head_dim) it is the QKV projection whose epilogue
    applies the bias, RoPE and the KV-cache write (launch_rope)."""
    return Int4Gemv(n, k, qweight, scales, path=path, bias=bias, out_dtype=out_dtype, plan=plan,
                    norm_weight=norm_weight, norm_eps=norm_eps, rope_heads=rope_heads)


def make_gate_up_silu(n, k, gate_q, gate_s, up_q, up_s, *, path="prmt", plan=None,
                      norm_weight=None, norm_eps=None) -> GateUpSilu:
    """The fused MLP input projection: silu(Wg x) * (Wu x) for Wg, Wu [n, k] in INT4 (x optionally
    RMSNorm(h) * norm_weight, as make_gemv_int4)."""
    return GateUpSilu(n, k, gate_q, gate_s, up_q, up_s, path=path, plan=plan,
                      norm_weight=norm_weight, norm_eps=norm_eps)


def gemv_bytes(n: int, k: int) -> int:
    """Bytes one GEMV over W [n, k] must read from memory: qweight, scales and x once."""
    return n * k // 2 + 2 * n * (k // GROUP_SIZE) + 2 * k


def _signature(path: str, *, out=types.float32, norm: bool = False):
    """The kernel's Numba signature (contiguous 1-D arrays; `out` float32 or float16)."""
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    if norm:
        activations = types.Tuple((types.float32[::1], flat_u32))
    elif path != "dp4a":
        activations = types.UniTuple(flat_u32, 1)
    else:
        activations = types.Tuple((flat_u32, types.float32[::1], types.int32[::1]))
    return types.void(flat_u32, flat_f16, flat_u32, flat_f16, activations, flat_f16, out[::1])


COMPILE_SM_COUNT = 132
# What each path's PTX must contain (its arithmetic and its shared-memory reads).
PATH_INSTRUCTIONS = {"prmt": ("prmt.b32", "fma.rn.f16x2", "ld.shared.v4.u32"), "dp4a": ("dp4a.s32.s32",),
                     "fixed16": ("dp4a.u32.u32", "dp4a.u32.s32", "ld.shared.v4.u32", "prmt.b32")}  # the grid the compile targets are built for (an H200's SMs)


def compile_targets() -> list[CompileTarget]:
    """Every path at every 7B linear (with the epilogue the engine uses there) and at a tiny shape."""
    hidden, intermediate, qkv, vocab = 3584, 18944, 4608, 152064
    targets = []
    for path in PATHS:
        must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32", "griddepcontrol.wait",
                "griddepcontrol.launch_dependents") + PATH_INSTRUCTIONS[path]
        for name, n, k, matrices, epilogue, out in (
                ("qkv", qkv, hidden, 1, "bias", types.float32),
                ("o_proj", hidden, hidden, 1, "residual", types.float32),
                ("gate_up", intermediate, hidden, 2, "silu", types.float16),
                ("down_proj", hidden, intermediate, 1, "residual", types.float32),
                ("lm_head", vocab, hidden, 1, "store", types.float32),
                ("tiny, float16 out", 16, 256, 1, "bias", types.float16)):
            plan = default_plan(n, k, matrices)
            kernel = gemv_kernel(path, n, k, matrices, plan, plan.grid(n, COMPILE_SM_COUNT), epilogue)
            targets.append(CompileTarget(f"gemv_int4_{path}[{name} {n}x{k}, {plan}]", kernel,
                                         _signature(path, out=out), must))
    # The decode step's QKV: fused norm, bias, RoPE and the KV write (both paths).
    pages = types.float16[:, :, :, ::1]
    rope_out = types.Tuple((types.float32[::1], pages, pages, types.int32[::1], types.int32[::1],
                            types.float32[:, ::1], types.float32[:, ::1]))
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    normed = types.Tuple((types.float32[::1], flat_u32))
    for path, activations, eps in (("prmt", normed, 1e-6), ("fixed16", normed, 1e-6),
                                   ("dp4a", types.Tuple((flat_u32, types.float32[::1], types.int32[::1])), None)):
        kernel = gemv_kernel(path, qkv, hidden, 1, ROPE_PLAN, ROPE_PLAN.grid(qkv, COMPILE_SM_COUNT), "rope", eps,
                             (28, 4, 128))
        targets.append(CompileTarget(f"gemv_int4_{path}[qkv {qkv}x{hidden}, rope + KV write]", kernel,
                                     types.void(flat_u32, flat_f16, flat_u32, flat_f16, activations, flat_f16,
                                                rope_out), ("griddepcontrol.wait", "cvt.rn.f16.f32")))
    # The kernels that read RMSNorm(h) (the engine's qkv, gate-up and lm_head).
    for path, normed_must in (("prmt", ("cvt.rn.f16x2.f32",)), ("fixed16", ("fma.rn.f32",))):
        must = ("ld.global.nc.v4.u32", "shfl.sync.bfly.b32") + PATH_INSTRUCTIONS[path] + normed_must
        for name, n, k, matrices, epilogue, out in (("qkv", qkv, hidden, 1, "bias", types.float32),
                                                    ("gate_up", intermediate, hidden, 2, "silu", types.float16),
                                                    ("lm_head", vocab, hidden, 1, "store", types.float32)):
            plan = default_plan(n, k, matrices)
            kernel = gemv_kernel(path, n, k, matrices, plan, plan.grid(n, COMPILE_SM_COUNT), epilogue, 1e-6)
            targets.append(CompileTarget(f"gemv_int4_{path}[{name} {n}x{k}, fused rmsnorm]", kernel,
                                         _signature(path, out=out, norm=True), must))
    return targets
