"""How fast can a kernel read HBM, and through which path: the ceiling any decode design streams its
weights against, measured rather than assumed (bench's roofline is a device-to-device copy, which
also writes).

Each form reads the same 2 GiB buffer once per launch (launches back to back in a CUDA graph):
- `loads`: every thread of a persistent grid issues 16-byte `ld.global.nc.v4` loads, `depth` of
  them before it uses the first (the product GEMV's register pipeline, kernels/gemv_int4_kernel.py);
- `bulk ring`: one block a SM, its producer lane copying its contiguous share with `cp.async.bulk`
  into a ring of `slots` x `slot_bytes`, 16 consumer warps that only wait for each slot's `full`
  mbarrier and release it (the weight stream of dev/megakernel_gemv_chain.py with no arithmetic).

    python dev/stream_read.py      # GB/s of each form and its share of the copy bandwidth
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
from numba import cuda, int64, types, uint32

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.kernels.gemv_int4_paths import U  # noqa: E402
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bulk_copy import bulk_copy_to_shared  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mbarrier import (fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx,  # noqa: E402
                                     mbarrier_init, mbarrier_wait)

BUFFER_BYTES = 2 * 2**30
CONSUMERS = 16


@functools.cache
def loads_kernel(words: int, grid: int, threads: int, depth: int):
    """Every thread reads 16-byte pieces t, t + T, ... (T threads in all), `depth` at a time."""
    T = U(grid * threads)
    quads = U(words // 4)
    rounds = words // 4 // (grid * threads) // depth

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, 1)}))
    def read(src, sink):
        t = U(U(cuda.blockIdx.x * U(threads)) + U(cuda.threadIdx.x))
        acc = U(0)
        q = t
        v = cuda.local.array(4 * 4, uint32)
        for _ in range(rounds):
            for d in range(depth):
                v[4 * d], v[4 * d + 1], v[4 * d + 2], v[4 * d + 3] = \
                    ld_global_nc_v4_u32(src, U(U(4) * U(q + U(U(d) * T))))
            for d in range(depth):
                acc ^= v[4 * d] ^ v[4 * d + 1] ^ v[4 * d + 2] ^ v[4 * d + 3]
            q = U(q + U(U(depth) * T))
        while q < quads:
            a, b, c, e = ld_global_nc_v4_u32(src, U(U(4) * q))
            acc ^= a ^ b ^ c ^ e
            q = U(q + T)
        if acc == U(0x9E3779B9):  # never, in practice: keeps the loads
            sink[0] = acc

    return read


@functools.cache
def ring_kernel(words: int, grid: int, slots: int, slot_bytes: int):
    """Block b copies words [b W / grid, (b + 1) W / grid) through its ring, slot after slot."""
    S = U(slots)
    QUADS = np.int64(words // 4)
    SLOT_WORDS = U(slot_bytes // 4)
    CONSUMER_THREADS = U(32 * CONSUMERS)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (32 * (CONSUMERS + 1), 1)}))
    def read(src, sink):
        full = cuda.shared.array(slots, types.uint64)
        empty = cuda.shared.array(slots, types.uint64)
        ring = cuda.shared.array(0, uint32)
        t = U(cuda.threadIdx.x)
        block = U(cuda.blockIdx.x)
        first = U(U(int64(block) * QUADS // int64(grid)) * U(4))  # 64-bit: block x quads passes 2^32
        last = U(U(int64(block + U(1)) * QUADS // int64(grid)) * U(4))
        pieces = U(U(U(last - first) + SLOT_WORDS - U(1)) // SLOT_WORDS)
        if t == U(0):
            for s in range(slots):
                mbarrier_init(full, s, 1)
                mbarrier_init(empty, s, int(CONSUMER_THREADS))
            fence_barrier_init()
        cuda.syncthreads()
        if t == CONSUMER_THREADS:
            j = U(0)
            while j < pieces:
                s = U(j % S)
                if j >= S:
                    mbarrier_wait(empty, s, U(U(U(j // S) - U(1)) & U(1)))
                at = U(first + U(j * SLOT_WORDS))
                n = min(SLOT_WORDS, U(last - at))
                mbarrier_arrive_expect_tx(full, s, U(n * U(4)))
                bulk_copy_to_shared(ring[U(s * SLOT_WORDS):U(U(s * SLOT_WORDS) + n)], src[at:at + n], U(n * U(4)),
                                    full, s)
                j = U(j + U(1))
        elif t < CONSUMER_THREADS:
            acc = U(0)
            j = U(0)
            while j < pieces:
                s = U(j % S)
                mbarrier_wait(full, s, U(U(j // S) & U(1)))
                acc ^= ring[U(U(s * SLOT_WORDS) + t)]
                mbarrier_arrive(empty, s)
                j = U(j + U(1))
            if acc == U(0x9E3779B9):
                sink[0] = acc

    return read, slots * slot_bytes


def timings(replays: int = 10) -> list[dict]:
    from pynanoqwen.device import sm_count
    from pynanoqwen.gpu_timing import copy_bandwidth, time_graph
    from pynanoqwen.launch import launch

    sms = sm_count()
    words = BUFFER_BYTES // 4
    src = cuda.to_device(np.arange(words, dtype=np.uint32))
    sink = cuda.device_array(1, np.uint32)
    stream = cuda.stream()
    copy = copy_bandwidth()
    forms = {}
    for blocks_per_sm, threads, depth in ((2, 256, 4), (2, 512, 4), (1, 1024, 4), (4, 256, 4), (2, 512, 2)):
        kernel = loads_kernel(words, sms * blocks_per_sm, threads, depth)
        forms[f"loads: {blocks_per_sm} x {threads} threads a SM, depth {depth}"] = (
            lambda kernel=kernel, grid=sms * blocks_per_sm, threads=threads:
            launch(kernel, grid, threads, stream, (src, sink), dependent=False))
    for slots, slot_bytes in ((40, 4096), (10, 16384), (5, 32768), (3, 65536), (12, 16384)):
        kernel, shared = ring_kernel(words, sms, slots, slot_bytes)
        forms[f"bulk ring: {slots} x {slot_bytes // 1024} KiB"] = (
            lambda kernel=kernel, shared=shared:
            launch(kernel, sms, 32 * (CONSUMERS + 1), stream, (src, sink), shared_bytes=shared, dependent=False))
    rows = []
    for name, enqueue in forms.items():
        seconds = time_graph(stream, enqueue, replays)
        rows.append({"form": name, "us a launch": 1e6 * seconds, "GB/s": BUFFER_BYTES / seconds / 1e9,
                     "share of copy": f"{100 * BUFFER_BYTES / seconds / copy:.0f}%"})
    return rows


if __name__ == "__main__":
    import argparse

    from harness import print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=10, help="graph replays a form (default 10)")
    args = parser.parse_args()
    print_table("reading 2 GiB once (copy bandwidth: device-to-device, read + write)", timings(args.replays))
