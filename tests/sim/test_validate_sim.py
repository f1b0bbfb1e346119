"""`validate`'s unit tier (pynanoqwen/unit_checks.py) under the CUDA simulator, on a small random
model with fresh random inputs.

Every check of the tier runs here: embedding, RMSNorm, RoPE + KV write, decode attention, the
linears (both GEMV paths at each linear, and the FP16 lm_head) and the argmax sampler. The linears
launch tens of thousands of simulated threads at the smallest legal shapes: ~30 s on 2 cores
since the simulated block's polling pauses (simulated.run_block_pausing; two minutes before, when
they ran on the GPU only, in tests/test_validate.py's gpu test).
"""

import numpy as np
import pytest

from pynanoqwen import unit_checks
from pynanoqwen.config import ModelConfig
from pynanoqwen.kernels import rmsnorm
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.reference import InMemoryWeights
from pynanoqwen.tensors import hf_tensors

assert SIMULATOR, "tests/sim runs under NUMBA_ENABLE_CUDASIM=1 (see tests/test_simulator.py)"

SMALL = ModelConfig(hidden_size=128, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                    vocab_size=192, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                    eos_token_id=0).validate()
CHECKS = [unit_checks.check_embedding, unit_checks.check_rmsnorm, unit_checks.check_rope_kv_write,
          unit_checks.check_attention, unit_checks.check_linears, unit_checks.check_argmax]


def small_weights(rng):
    """Random weights; norm weights 1 + N(0, 0.3), so an RMSNorm that ignores them is visibly wrong."""
    hf = {}
    for name, shape in hf_tensors(SMALL).items():
        w = rng.standard_normal(shape).astype(np.float32)
        hf[name] = 1 + 0.3 * w if name.endswith("norm.weight") else 0.1 * w
    return InMemoryWeights.quantize(SMALL, hf, lm_head_int4=False)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_unit_check_passes_on_the_real_kernel(check):
    rng = np.random.default_rng()
    results = list(check(small_weights(rng), rng))
    assert results and all(r.status == "PASS" for r in results), results


def test_unit_check_catches_a_wrong_kernel(monkeypatch):
    """An RMSNorm that forgets its weight must FAIL the check (the bound is not vacuous)."""
    real = rmsnorm.make_rmsnorm

    class Unweighted:
        def __init__(self, hidden_size, eps):
            self.norm = real(hidden_size, eps)

        def launch(self, stream, h, weight, xn):
            from numba import cuda

            self.norm.launch(stream, h, cuda.to_device(np.ones(weight.shape, np.float16)), xn)

    monkeypatch.setattr(rmsnorm, "make_rmsnorm", Unweighted)
    rng = np.random.default_rng()
    results = list(unit_checks.check_rmsnorm(small_weights(rng), rng))
    assert len(results) == 1 and results[0].status == "FAIL" and "worst error" in results[0].detail
