"""The measuring scripts of dev/ (sweeps and the profiler's launcher) import and parse their options
on a CPU machine: a name error found only on the GPU costs a run (docs/PERFORMANCE.md, lessons)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev"
SCRIPTS = ["attention_splits.py", "attention_timeline.py", "gemv_plans.py", "profile_one.py", "ptx_loop_mix.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_dev_script_starts(script):
    proc = subprocess.run([sys.executable, str(DEV / script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


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
