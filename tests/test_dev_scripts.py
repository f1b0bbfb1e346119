"""The measuring scripts of dev/ (sweeps and the profiler's launcher) import and parse their options
on a CPU machine: a name error found only on the GPU costs a run (docs/PERFORMANCE.md, lessons)."""

import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev"
SCRIPTS = ["attention_splits.py", "attention_timeline.py", "gemv_plans.py", "profile_one.py"]


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
