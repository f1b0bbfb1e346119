"""One wgmma on the GPU against numpy (tests/sim/wgmma_probe.py says what is checked and why the
bound holds); the simulator runs the same check on the twin (tests/sim/test_gemm_sim.py)."""

import pytest

from sim.wgmma_probe import check_one_wgmma

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("step", [0, 3])
@pytest.mark.parametrize("mn_major", [False, True])
def test_one_wgmma_matches_numpy(n, step, mn_major):
    check_one_wgmma(n, step, mn_major)
