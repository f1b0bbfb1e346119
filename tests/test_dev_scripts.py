"""The measuring scripts of dev/ (sweeps and the profiler's launcher) import and parse their options
on a CPU machine: a name error found only on the GPU costs a run (docs/PERFORMANCE.md, lessons)."""

import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev"
SCRIPTS = ["attention_splits.py", "gemv_plans.py", "profile_one.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_dev_script_starts(script):
    proc = subprocess.run([sys.executable, str(DEV / script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
