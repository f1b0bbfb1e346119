"""The KV-cache page layout (pynanoqwen/kernels/kv_layout.py) on the host: its definition, chunk c
of slot s at chunk c ^ (s % 8), written out index by index, and the head_dim it needs. The kernels
that write and read pages are checked against it in the simulator (tests/sim) and on the GPU."""

import numpy as np
import pytest

from pynanoqwen.errors import ConfigError
from pynanoqwen.kernels.kv_layout import swizzle_rows


@pytest.mark.parametrize("head_dim", [64, 128])
def test_swizzle_rows_puts_chunk_c_of_slot_s_at_c_xor_s_mod_8(head_dim):
    rows = np.random.default_rng().standard_normal((3, 2, 16, head_dim)).astype(np.float16)
    stored = swizzle_rows(rows)
    for s in range(16):
        for c in range(head_dim // 8):
            np.testing.assert_array_equal(stored[..., s, 8 * (c ^ (s % 8)):8 * (c ^ (s % 8)) + 8],
                                          rows[..., s, 8 * c:8 * c + 8])
    np.testing.assert_array_equal(swizzle_rows(stored), rows)  # its own inverse
    assert not np.array_equal(stored, rows)


@pytest.mark.parametrize("head_dim", [16, 32, 96])
def test_a_head_dim_the_swizzle_does_not_span_is_refused(head_dim):
    with pytest.raises(ConfigError, match="multiple of 64"):
        swizzle_rows(np.zeros((16, head_dim), np.float16))
