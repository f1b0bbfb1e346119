"""Runs tests/sim (kernel logic at tiny sizes) under the CUDA simulator in a child process.

The simulator must be switched on before numba.cuda is first imported, and the rest of the suite
needs the real numba.cuda (compile_ptx for sm_90), so the two cannot share one process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SIM_DIR = Path(__file__).parent / "sim"
SIM_FILES = sorted(path.name for path in SIM_DIR.glob("test_*.py"))


# A child a file, so that the test command's workers share the ~7 minutes of simulation.
@pytest.mark.parametrize("sim_file", SIM_FILES)
def test_kernels_under_cuda_simulator(sim_file):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SIM_DIR / sim_file)],
                          env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-5000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-5000:]
