"""The primitives of programmatic dependent launch and of decode attention's loads and warp sync
compile inline for sm_90 (no `call`), in the order the kernel wrote them; the L2-only loads' twins
return what the array holds."""

import numpy as np
from numba import cuda, float32, types

from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents
from pynanoqwen.ptx.loads import ld_global_cg_f32, ld_global_cg_f32_simulated, ld_global_cg_v4_f32, \
    ld_global_cg_v4_f32_simulated
from pynanoqwen.ptx.warp import syncwarp


def dependent(values, out):
    launch_dependents()
    grid_dependency_wait()
    i = cuda.grid(1)
    a, b, c, d = ld_global_cg_v4_f32(values, 4 * i)
    syncwarp()
    out[i] = a + b + c + d + ld_global_cg_f32(values, i)


def test_griddepcontrol_cg_loads_and_warp_sync_compile_inline_in_order():
    ptx, _ = cuda.compile_ptx(dependent, types.void(float32[::1], float32[::1]), cc=(9, 0))
    body = ptx[ptx.index(".entry"):]
    order = [body.index(text) for text in ("griddepcontrol.launch_dependents;", "griddepcontrol.wait;",
                                           "ld.global.cg.v4.f32", "bar.warp.sync", "ld.global.cg.f32")]
    assert order == sorted(order), "the kernel's reads must stay after the wait, where it put them"
    assert "call" not in body.split()


def test_cg_load_twins_read_the_array():
    values = np.random.default_rng().standard_normal(8).astype(np.float32)
    assert ld_global_cg_v4_f32_simulated(values, 4) == tuple(float(v) for v in values[4:8])
    assert ld_global_cg_f32_simulated(values, 3) == float(values[3])
