"""One wgmma (ptx/wgmma.py) against numpy, run by tests/test_ptx_wgmma_gpu.py on the GPU and by
test_gemm_sim.py under the simulator, so the simulator twin and the instruction are held to the same
layouts: A (64 x 16 FP16) from the documented register fragments, B (N x 16) written into the
documented 128-byte-swizzled shared layout at k step j of its 64-wide slab (wgmma_f16), or as 16
MN-major k rows at k step j of slabs of 64 rows (wgmma_f16_mn), D read back from the documented
accumulator layout.

Random FP16 inputs of magnitude < 4 with 16 terms per dot product: the tensor core aligns the
addends to the largest and keeps >= 24 significant bits (Fasi et al., see tests/test_gemm_gpu.py),
so the bound is 17 x 2^-23 of the largest |a b| sum; a layout mistake moves values by O(1).
"""

import numpy as np
from numba import cuda, float32, uint32

from pynanoqwen.ptx.wgmma import fence_proxy_async_shared, shared_byte_address, wgmma_commit_group, wgmma_f16, \
    wgmma_f16_mn, wgmma_fence, wgmma_wait_group

MN_SLAB_ROWS = 64  # k rows a slab of the MN-major probe holds: 4 k steps, so step 3 is a slab's last
MN_SLAB_BYTES = MN_SLAB_ROWS * 128


def probe(n: int, step: int):
    """A kernel computing D = A B^T with one wgmma m64n{n}k16, B at k step `step` of its slab."""
    registers = n // 2  # a constant for cuda.local.array

    @cuda.jit
    def one_wgmma(a_words, b_words, d):
        tile = cuda.shared.array(0, uint32)
        tid = cuda.threadIdx.x
        base = (1024 - shared_byte_address(tile, 0) % 1024) % 1024 // 4
        for idx in range(tid, n * 2, 128):  # row r's two 16-byte chunks of this k step
            r, c = idx // 2, idx % 2
            chunk = 2 * step + c
            dst = base + (r // 8) * 256 + (r % 8) * 32 + 4 * (chunk ^ (r % 8))
            for w in range(4):
                tile[dst + w] = b_words[r * 8 + 4 * c + w]
        fence_proxy_async_shared()
        cuda.syncthreads()
        lane = tid % 32
        g, t = lane // 4, lane % 4
        row = 16 * (tid // 32) + g
        acc = cuda.local.array(registers, float32)
        for i in range(registers):
            acc[i] = float32(0)
        wgmma_fence()
        wgmma_f16(acc, n, a_words[row * 8 + t], a_words[(row + 8) * 8 + t], a_words[row * 8 + 4 + t],
                  a_words[(row + 8) * 8 + 4 + t], tile, base + 8 * step)
        wgmma_commit_group()
        wgmma_wait_group(0)
        for i in range(n // 8):
            col = 8 * i + 2 * t
            d[row, col], d[row, col + 1] = acc[4 * i], acc[4 * i + 1]
            d[row + 8, col], d[row + 8, col + 1] = acc[4 * i + 2], acc[4 * i + 3]

    return one_wgmma


def probe_mn(n: int, step: int):
    """A kernel computing D = A B^T with one wgmma_f16_mn m64n{n}k16: B^T's 16 k rows at k step
    `step` of slabs of MN_SLAB_ROWS rows, each row's n values in 64-wide slabs."""
    registers = n // 2

    @cuda.jit
    def one_wgmma_mn(a_words, b_words, d):
        tile = cuda.shared.array(0, uint32)
        tid = cuda.threadIdx.x
        base = (1024 - shared_byte_address(tile, 0) % 1024) % 1024 // 4
        for idx in range(tid, 16 * (n // 8), 128):  # chunk c (values 8c..8c+7) of k row k
            k, c = idx // (n // 8), idx % (n // 8)
            row = 16 * step + k
            dst = base + (c // 8) * (MN_SLAB_BYTES // 4) + row * 32 + 4 * ((c % 8) ^ (row % 8))
            for w in range(4):  # b is n x 16: value 8c + 2w, +1 of k row k
                lo = b_words[(8 * c + 2 * w) * 16 + k]
                hi = b_words[(8 * c + 2 * w + 1) * 16 + k]
                tile[dst + w] = uint32(lo) | (uint32(hi) << uint32(16))
        fence_proxy_async_shared()
        cuda.syncthreads()
        lane = tid % 32
        g, t = lane // 4, lane % 4
        row = 16 * (tid // 32) + g
        acc = cuda.local.array(registers, float32)
        for i in range(registers):
            acc[i] = float32(0)
        wgmma_fence()
        wgmma_f16_mn(acc, n, a_words[row * 8 + t], a_words[(row + 8) * 8 + t], a_words[row * 8 + 4 + t],
                     a_words[(row + 8) * 8 + 4 + t], tile, base + 512 * step, MN_SLAB_BYTES)
        wgmma_commit_group()
        wgmma_wait_group(0)
        for i in range(n // 8):
            col = 8 * i + 2 * t
            d[row, col], d[row, col + 1] = acc[4 * i], acc[4 * i + 1]
            d[row + 8, col], d[row + 8, col + 1] = acc[4 * i + 2], acc[4 * i + 3]

    return one_wgmma_mn


def check_one_wgmma(n, step, mn_major=False):
    rng = np.random.default_rng()
    a = rng.uniform(-4, 4, (64, 16)).astype(np.float16)
    b = rng.uniform(-4, 4, (n, 16)).astype(np.float16)
    d = np.zeros((64, n), np.float32)
    d_device = cuda.to_device(d)
    if mn_major:
        shared = (n // 64) * MN_SLAB_BYTES + 1024
        probe_mn(n, step)[1, 128, 0, shared](cuda.to_device(a.view(np.uint32).ravel()),
                                             cuda.to_device(b.view(np.uint16).ravel()), d_device)
    else:
        shared = (n // 8) * 1024 + 1024
        probe(n, step)[1, 128, 0, shared](cuda.to_device(a.view(np.uint32).ravel()),
                                          cuda.to_device(b.view(np.uint32).ravel()), d_device)
    result = d_device.copy_to_host().astype(np.float64)
    expected = a.astype(np.float64) @ b.astype(np.float64).T
    bound = 17 * 2.0**-23 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T)
    worst = np.unravel_index(np.argmax(np.abs(result - expected) - bound), result.shape)
    assert np.all(np.abs(result - expected) <= bound), (worst, result[worst], expected[worst])
