"""The measuring scripts of dev/ (sweeps and the profiler's launcher) import and parse their options
on a CPU machine: a name error found only on the GPU costs a run (docs/PERFORMANCE.md, lessons)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev"
SCRIPTS = ["attention_merge_bound.py", "attention_splits.py", "attention_timeline.py", "gemv_plans.py", "gemv_residency.py", "gemv_timeline.py", "l2_prefetch_decode.py",
           "prefill_stages.py", "profile_one.py", "ptx_loop_mix.py", "stream_read.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_dev_script_starts(script):
    proc = subprocess.run([sys.executable, str(DEV / script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_attention_merge_bound_finds_its_anchor_once():
    """dev/attention_merge_bound.py's copy of the product kernel: its anchor occurs once (the copy
    loads) and the copy returns before the fence."""
    sys.path.insert(0, str(DEV))
    try:
        import attention_merge_bound
    finally:
        sys.path.remove(str(DEV))
    source = attention_merge_bound.edited_kernel_source("test", "", [(attention_merge_bound.ANCHOR,
                                                                      "        return\n" + attention_merge_bound.ANCHOR)])
    assert source.index("        return\n" + attention_merge_bound.ANCHOR) < source.index("cuda.threadfence()")
    assert hasattr(attention_merge_bound.without_merge(), "make_decode_attention")


def test_attention_timeline_finds_every_anchor_in_the_kernel():
    """dev/attention_timeline.py instruments the product kernel's source: each of its anchors must
    still occur exactly once, and the result must be Python."""
    sys.path.insert(0, str(DEV))
    try:
        import attention_timeline
    finally:
        sys.path.remove(str(DEV))
    source = attention_timeline.instrumented_source()
    compile(source, "attention_timeline_kernel", "exec")
    assert source.count("gtimer()") == 15


def test_gemv_timeline_instruments_the_product_gemv_and_compiles_for_sm90():
    """dev/gemv_timeline.py's copy of the product GEMV: every anchor found once, eight stamps, and
    the down_proj kernel (split tiles, residual epilogue) with an int64 stamps array where
    bias_values goes compiles to PTX that reads %globaltimer."""
    from numba import cuda, types

    from pynanoqwen.kernels.gemv_int4 import default_plan

    sys.path.insert(0, str(DEV))
    try:
        import gemv_timeline
    finally:
        sys.path.remove(str(DEV))
    source = gemv_timeline.instrumented_source()
    assert source.count("gtimer()") == 8
    module = gemv_timeline.load_source(source, "gemv_timeline_kernel")
    n, k = 3584, 18944
    plan = default_plan(n, k)
    kernel = module.gemv_kernel("prmt", n, k, 1, plan, plan.grid(n, 132), "residual")
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    signature = types.void(flat_u32, flat_f16, flat_u32, flat_f16, types.UniTuple(flat_u32, 1), types.int64[::1],
                           types.float32[::1])
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    assert ptx.count("%globaltimer") == 8 and "griddepcontrol.wait" in ptx


def test_ptx_loop_mix_counts_the_wgmma_k_loop():
    """dev/ptx_loop_mix.py on the prefill GEMM's smallest wgmma tile: its k loop runs a 128-wide
    scale group, two k tiles, each with 4 wgmma.mma_async (64 / 16 k steps) plus a fence, a
    commit and a wait, and 16 prmt (one a packed pair a lane): wgmma 14, prmt 32."""
    proc = subprocess.run([sys.executable, str(DEV / "ptx_loop_mix.py"), "plain_wgmma_64x64[tiny"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loops = [line for line in proc.stdout.splitlines() if line.startswith("  a loop of")]
    counts = dict(re.findall(r"(\w+) (\d+)", loops[0].split(":", 1)[1])) if loops else {}
    assert counts.get("wgmma") == "14" and counts.get("prmt") == "32", proc.stdout
