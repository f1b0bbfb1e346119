"""What the dev/ scripts share: random INT4 weights, a float64 check of a GEMM, and its timing;
decode attention at 7B shapes: its kernels built, its inputs, its float64 check and its timing.

Weights are random (speed does not depend on values); the timing rotates enough weight copies
that together they exceed the L2 twice, so every call reads its weights from HBM, as a prefill
does layer after layer; calls run inside a CUDA graph between events (pynanoqwen/gpu_timing.py),
as bench's GEMM table times the product's tiles.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from pynanoqwen.bench_kernels import random_int4  # noqa: F401 (the dev scripts take it from here)
from pynanoqwen.config import PRESETS
from pynanoqwen.gpu_timing import time_graph, weight_copies
from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.oracles import Check, bound_report, gemm_epilogue_oracle
from pynanoqwen.quant import dequantize_int4

SEVEN_B = PRESETS["7b"]
LINEARS_7B = {"qkv": (SEVEN_B.q_size + 2 * SEVEN_B.kv_size, SEVEN_B.hidden_size),
              "o_proj": (SEVEN_B.hidden_size, SEVEN_B.q_size),
              "gate_up": (SEVEN_B.intermediate_size, SEVEN_B.hidden_size),
              "down_proj": (SEVEN_B.hidden_size, SEVEN_B.intermediate_size)}


def edited_kernel_source(who: str, header: str, edits: list[tuple[str, str]], sections=(),
                         kernel: str = "attention_decode") -> str:
    """The source of kernels/`kernel`.py (decode attention by default), runnable outside its
    package, with `header` after its __future__ import, each (old, new) of `edits` applied (old
    must occur exactly once) and each (start, end, new) of `sections` (the text from start up to
    end) replaced: how the attention variants and the timelines stay the product's kernel but for
    their edits. A change of the product that moves an anchor stops `who` with the anchor, rather
    than time something else."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / f"pynanoqwen/kernels/{kernel}.py").read_text()
    source = source.replace("from ..", "from pynanoqwen.").replace("from . import", "from pynanoqwen.kernels import")
    source = source.replace("from .", "from pynanoqwen.kernels.")  # a sibling module: from .gemv_int4_paths
    source = source.replace("from __future__ import annotations\n", "from __future__ import annotations\n" + header, 1)
    for old, new in edits + [(start, None) for start, _, _ in sections]:
        if source.count(old) != 1:
            raise SystemExit(f"{who}: the product kernel changed; this anchor occurs {source.count(old)} times:\n{old}")
        if new is not None:
            source = source.replace(old, new)
    for start, end, new in sections:
        begin = source.index(start)
        stop = source.find(end, begin)
        if stop < 0:
            raise SystemExit(f"{who}: the product kernel changed; nothing after this anchor ends with:\n{end}")
        source = source[:begin] + new + source[stop:]
    return source


# A header for edited_kernel_source: gtimer(), the GPU's %globaltimer in ns (256 ns steps on the
# H200), for the timelines' stamps.
TIMER = '''
from numba import types as _types
from numba.cuda.extending import intrinsic as _intrinsic
from llvmlite import ir as _ir
from pynanoqwen.ptx.mbarrier import inline_ptx as _inline_ptx


@_intrinsic
def gtimer(typingctx):
    def codegen(context, builder, sig, args):
        return _inline_ptx(builder, "mov.u64 $0, %globaltimer;", "=l,~{memory}", [], _ir.IntType(64))
    return _types.int64(), codegen
'''


def load_source(source: str, name: str):
    """Run `source` as a module called `name`."""
    import types as pytypes

    module = pytypes.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def variant_compile_target(module, name: str, signature, num_splits: int, drop: tuple[str, ...] = (),
                           add: tuple[str, ...] = ()):
    """An attention variant's 7B kernel (`module` from load_source) as a CompileTarget for
    tests/test_dev_variants.py: the product's must-contain instructions less `drop`, plus `add`."""
    from pynanoqwen.kernels import CompileTarget

    product = module.compile_targets()[0]
    kernel = module._build_kernel(SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim, num_splits, module.STAGES,
                                  module.CONSUMERS, module.MIN_PAGES_PER_SPLIT)
    must = tuple(i for i in product.must_contain if not i.startswith(drop)) + add
    return CompileTarget(name, kernel, product.signature if signature is None else signature, must)


def attention_inputs(rng, contexts: list[int], layers: int):
    """Decode attention's inputs at 7B shapes for the longest of `contexts`, on the device:
    (max_pages, a (K, V) pool pair of each layer's own, so the K/V stream comes from HBM as in a
    decode step, a shuffled page table, q)."""
    from pynanoqwen.kernels import PAGE_SIZE

    max_pages = -(-max(contexts) // PAGE_SIZE)
    shape = (max_pages, SEVEN_B.num_kv_heads, PAGE_SIZE, SEVEN_B.head_dim)
    k_host, v_host = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    pools = [(cuda.to_device(k_host), cuda.to_device(v_host)) for _ in range(layers)]
    page_table = cuda.to_device(rng.permutation(max_pages).astype(np.int32))
    q = cuda.to_device((3 * rng.standard_normal((SEVEN_B.num_heads, SEVEN_B.head_dim))).astype(np.float32))
    return max_pages, pools, page_table, q


def seven_b_attention(module=None, two_blocks_a_sm: bool = False, **options):
    """build(max_pages) for the decode-attention kernel of `module` (a variant loaded with
    load_source; the product's kernels/attention_decode.py when None) at 7B shapes. two_blocks_a_sm
    doubles the default splits and halves the ring, so two blocks share each SM's shared memory."""
    if module is None:
        from pynanoqwen.kernels import attention_decode as module
    shape = (SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim)

    def build(max_pages):
        doubled = ({"num_splits": 2 * module.default_num_splits(SEVEN_B.num_kv_heads), "stages": module.STAGES // 2}
                   if two_blocks_a_sm else {})  # the SM count is asked for here, on the GPU
        return module.make_decode_attention(*shape, max_pages, **{**doubled, **options})

    return build


def check_decode_attention(builders: dict, contexts: tuple[int, ...], rng, launches: int = 1) -> list[Check]:
    """Each decode-attention kernel of `builders` (name -> build(max_pages)) at each context, 7B shapes,
    against float64 (oracles.attention_oracle's bound): fresh random q and K/V, a shuffled page
    table, NaN in every slot outside the context. `launches` > 1 runs each launch again on the same
    inputs, so a counter a launch leaves behind shows."""
    from pynanoqwen.kernels import PAGE_SIZE
    from pynanoqwen.unit_checks import random_attention_case

    heads, kv_heads, head_dim = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim
    max_pages = -(-max(contexts) // PAGE_SIZE)
    kernels = {name: build(max_pages) for name, build in builders.items()}
    results = []
    for context in contexts:
        inputs, expected, bound = random_attention_case(rng, heads, kv_heads, head_dim, max_pages, context)
        device = [cuda.to_device(a) for a in inputs]
        for name, attention in kernels.items():
            out = cuda.to_device(np.full(heads * head_dim, np.nan, np.float16))
            stream = cuda.stream()
            for _ in range(launches):
                attention.launch(stream, *device, out)
            stream.synchronize()
            error = np.abs(out.copy_to_host().astype(np.float64) - expected)
            results.append(bound_report(f"{name} context {context}", error, bound))
    return results


def time_decode_attention(builders: dict, contexts: tuple[int, ...]) -> list[dict]:
    """us a launch of each kernel of `builders` (name -> build(max_pages)) at each context: 28
    launches over their own KV pools in one CUDA graph (PDL), as dev/attention_splits.py times them."""
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    max_pages, pools, page_table, q = attention_inputs(rng, list(contexts), SEVEN_B.num_layers)
    out = cuda.device_array(SEVEN_B.num_heads * SEVEN_B.head_dim, np.float16)
    kernels = {name: build(max_pages) for name, build in builders.items()}
    rows = []
    for context in contexts:
        pos = cuda.to_device(np.array([context - 1], np.int32))
        row = {"context": context}
        for name, attention in kernels.items():
            def enqueue(attention=attention):
                for k_pages, v_pages in pools:
                    attention.launch(stream, q, k_pages, v_pages, page_table, pos, out)

            row[name] = 1e6 * time_graph(stream, enqueue, replays=20) / len(pools)
        rows.append(row)
    return rows


def check_gemm(name: str, launch, n: int, k: int, m: int, epilogue: str, rng, extra_bound=None) -> Check:
    """Run launch(stream, weights, bias, x, out) for an N x K linear with this epilogue (weights: one
    (qweight, scales) per matrix, bias float16 or None) on fresh random operands, and check out[:m]
    against float64 within the product's bounds (oracles.py), plus extra_bound(magnitude, out
    before) if the variant rounds more (magnitude: |x| |W|^T)."""
    weights = [random_int4(rng, n, k) for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    x = rng.standard_normal((m, k)).astype(np.float16)
    out = (rng.standard_normal((m, n)) if epilogue == "residual" else np.zeros((m, n)))
    out = out.astype(np.float16 if epilogue == "gate_up_silu" else np.float32)
    out_device = cuda.to_device(out)
    stream = cuda.stream()
    launch(stream, [tuple(cuda.to_device(a) for a in w) for w in weights], None if bias is None else cuda.to_device(bias),
           cuda.to_device(x), out_device)
    stream.synchronize()
    expected, bound = gemm_epilogue_oracle(weights, x, epilogue, out, bias)
    if extra_bound is not None:
        magnitude = np.abs(x.astype(np.float64)) @ np.abs(dequantize_int4(*weights[0], np.float64)).T
        bound = bound + extra_bound(magnitude, out)
    return bound_report(name, np.abs(out_device.copy_to_host().astype(np.float64) - expected), bound)


def time_calls(build, n: int, k: int, m: int, out_dtype=np.float32, matrices: int = 1, replays: int = 5) -> float:
    """Microseconds per call of call = build([(qweight, scales)] * matrices), call(stream, x, out),
    with the weights rotated through 2x the L2."""
    rng = np.random.default_rng(0)
    copies = weight_copies(matrices * (n * k // 2 + n * k // 64))
    calls = [build([tuple(cuda.to_device(a) for a in random_int4(rng, n, k)) for _ in range(matrices)])
             for _ in range(copies)]
    stream = cuda.stream()
    x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16), stream=stream)
    out = cuda.to_device(np.zeros((m, n), out_dtype), stream=stream)
    count = max(copies, 8)
    seconds = time_graph(stream, lambda: [calls[c % copies](stream, x, out) for c in range(count)], replays)
    return 1e6 * seconds / count


def residual_gemv_checks(title: str, gemv, x: np.ndarray, h: np.ndarray, expected: np.ndarray, bound: np.ndarray,
                         launches: int) -> list:
    """A residual GEMV variant's checks: `launches` runs of gemv.launch(stream, x, h_device) from the same
    float32 h, the first against expected (float64) within bound, and all of them bit for bit alike."""
    from pynanoqwen.oracles import bound_report, passed

    outs = []
    for _ in range(launches):
        h_device = cuda.to_device(h)
        gemv.launch(0, cuda.to_device(x), h_device)
        outs.append(h_device.copy_to_host())
    results = [bound_report(title, np.abs(outs[0].astype(np.float64) - expected), bound)]
    if launches > 1:
        results.append(passed(f"{title}: {launches} runs", all(np.array_equal(o, outs[0]) for o in outs),
                              "bit-identical"))
    return results


def residual_gemv_timings(shapes: dict, variants, replays: int) -> list[dict]:
    """us a call, GB/s and share of copy of the product's residual GEMV (its default plan) and of a
    variant's forms at each shape {name: (n, k)}: variants(name) gives {label: make}, make(n, k,
    qweight, scales) a launch(stream, x, out); back-to-back PDL launches in a CUDA graph, weights
    rotated through twice the L2 (time_calls)."""
    from pynanoqwen.gpu_timing import copy_bandwidth
    from pynanoqwen.kernels.gemv_int4 import gemv_bytes, make_gemv_int4

    def product(n, k, qweight, scales):
        gemv = make_gemv_int4(n, k, qweight, scales)
        return lambda stream, x, out: gemv.launch(stream, x.reshape(k), out.reshape(n), residual=True)

    copy = copy_bandwidth()
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = gemv_bytes(n, k)
        for form, make in {"product": product, **variants(name)}.items():
            us = time_calls(lambda weights, make=make, n=n, k=k: make(n, k, *weights[0]), n, k, 1, replays=replays)
            rows.append({"linear": name, "form": form, "us a call": us, "GB/s": nbytes / us / 1e3,
                         "share of copy": f"{100 * nbytes / (us * 1e-6) / copy:.0f}%"})
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


EPILOGUES_7B = {"qkv": "bias", "o_proj": "residual", "gate_up": "gate_up_silu", "down_proj": "residual"}


def product_gemm(n: int, k: int, epilogue: str, tiles=None):
    """launch(stream, weights, bias, x, out) through the product's GEMM factories at `tiles`
    (None: default_tiles_for's choice), for check_gemm and time_calls."""
    def launch(stream, weights, bias, x, out):
        m = x.shape[0]
        if epilogue == "gate_up_silu":
            make_gate_up_silu_gemm(n, k, *weights[0], *weights[1], tiles=tiles).launch(stream, x, out, m)
        else:
            make_gemm_int4(n, k, *weights[0], bias=bias, tiles=tiles).launch(stream, x, out, m,
                                                                         residual=epilogue == "residual")
    return launch


def time_product_gemm(n: int, k: int, m: int, epilogue: str, tiles=None) -> float:
    """Microseconds per call of the product's GEMM at `tiles`, as bench's GEMM table times it."""
    matrices = 2 if epilogue == "gate_up_silu" else 1

    def build(weights):
        if matrices == 2:
            gemm = make_gate_up_silu_gemm(n, k, *weights[0], *weights[1], tiles=tiles)
            return lambda stream, x, out: gemm.launch(stream, x, out, m)
        gemm = make_gemm_int4(n, k, *weights[0], tiles=tiles)
        return lambda stream, x, out: gemm.launch(stream, x, out, m, residual=epilogue == "residual")

    return time_calls(build, n, k, m, np.float16 if matrices == 2 else np.float32, matrices)


def run(check, timings, title: str) -> None:
    """What `python dev/<variant>.py` does: the variant's float64 checks, then its timing table."""
    for result in check(np.random.default_rng()):
        print(result.line())
    print_table(title, timings())
