"""The 16-byte store st.global.v4.f32 (ptx/loads.py) compiles inline for sm_90, stays where the kernel
wrote it between loads of the same words (the TMA GEMM's K-chunk folds load four quads, then store
their sums), and its twin writes the four words."""

import numpy as np
from numba import cuda, float32, types

from pynanoqwen.ptx.loads import ld_global_cg_v4_f32, st_global_v4_f32, st_global_v4_f32_simulated


def fold_twice(totals, add):
    i = 4 * cuda.grid(1)
    a, b, c, d = ld_global_cg_v4_f32(totals, i)
    st_global_v4_f32(totals, i, a + add[0], b + add[1], c + add[2], d + add[3])
    e, f, g, h = ld_global_cg_v4_f32(totals, i)
    st_global_v4_f32(totals, i, e + add[0], f + add[1], g + add[2], h + add[3])


def test_the_v4_store_compiles_inline_between_its_loads():
    ptx, _ = cuda.compile_ptx(fold_twice, types.void(float32[::1], float32[::1]), cc=(9, 0))
    body = ptx[ptx.index(".entry"):]
    lines = [line.strip().split()[0] for line in body.splitlines()
             if "ld.global.cg.v4.f32" in line or "st.global.v4.f32" in line]
    assert lines == ["ld.global.cg.v4.f32", "st.global.v4.f32"] * 2, "a load moved across the store"
    assert "call" not in body.split()


def test_the_store_twin_writes_four_words():
    totals = np.zeros(12, np.float32)
    values = np.random.default_rng().standard_normal(4).astype(np.float32)
    st_global_v4_f32_simulated(totals, 4, *values)
    assert np.array_equal(totals[4:8], values) and not totals[:4].any() and not totals[8:].any()
