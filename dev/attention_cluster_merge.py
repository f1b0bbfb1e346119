"""Decode attention whose split partials meet in a thread-block cluster's shared memory, against
the product's kernel (kernels/attention_decode.py), which meets them through global memory.

The product's blocks each store their split's partial (max, sum, accumulator per query head) to
global memory, fence, count themselves in with an atomic, and the last block of the KV head reads
every partial back: at short contexts that merge is more than half of a launch (5.9 of 8.7 us at
context 16, docs/PERFORMANCE.md, dev/attention_timeline.py). Here the splits of a KV head run in
clusters of CLUSTER blocks (grid 4 x 32 at 7B, cluster 1 x 8). Each block stores its partial
straight into the shared memory of its cluster's first block (`mapa` + `st.shared::cluster`,
distributed shared memory), the cluster meets at one `barrier.cluster` (release / acquire), and
that leader merges from its own shared memory. When one cluster holds every split with pages (up
to 8 splits: 512 tokens at the product's 4 pages a split) the leader writes attn and nothing goes
through global memory; otherwise the clusters' leaders merge their partials as the product's blocks
do, over at most num_splits / CLUSTER partials instead of num_splits.

Measured, it loses (docs/PERFORMANCE.md, 2026-12-05 night, H100, us a launch): 7.0 against the
product's 7.1 at 16 tokens, 10.7 against 8.0 at 512, 66.2 against 34.4 at 32000 in clusters of 8;
clusters of 2 and 4 lose more at 512 (14.5, 15.8). At 8 (175 KiB of shared memory a block) the
driver fits 15 of the launch's 16 clusters at once (`max_active_clusters`), at 4 30 of 32, so a
cluster waits for a second wave; clusters of 2 fit (66 of 64) and lose all the same.

The variant is the product's source with the edits below applied at import (each anchor must occur
once, so a change of the product's kernel stops this script instead of measuring something else).
The simulator runs one block at a time, so tests/sim/test_attention_sim.py checks it there with
clusters of one block (each block its own leader: both merge paths, not the distributed shared
memory); the rest is checked on the GPU:

    python dev/attention_cluster_merge.py

DSMEM rules followed (CUDA Programming Guide, "Distributed Shared Memory"): a block writes into
another's shared memory only after the cluster has synchronised once (every block started; here
an arrive before griddepcontrol.wait and its wait before the stores), and the block whose memory
is written (the leader) outlives the writes (it waits at the barrier after them).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (check_decode_attention, edited_kernel_source, load_source,  # noqa: E402
                     seven_b_attention, time_decode_attention, variant_compile_target)

CLUSTER = 8  # blocks a cluster: the portable maximum
NUM_SPLITS = 32  # splits a KV head: a multiple of CLUSTER (the product's 7B default is 33)

INTRINSICS = '''
from llvmlite import ir as _ir
from numba.cuda import cgutils as _cgutils
from numba.cuda.extending import intrinsic as _intrinsic
from pynanoqwen.ptx import SIMULATOR as _SIMULATOR, simulator_twin as _simulator_twin
from pynanoqwen.ptx.mbarrier import inline_ptx as _inline_ptx, shared_address as _shared_address

CLUSTER = %d
if _SIMULATOR and CLUSTER != 1:
    raise RuntimeError("the CUDA simulator runs one block at a time: only clusters of one block")
CLUSTER_SHAPE = None if _SIMULATOR else (1, CLUSTER)


def _nothing():
    return None


def _block_barrier():  # a cluster of one block, in the simulator
    cuda.syncthreads()  # this module's `cuda`, which the simulator swaps for its own during a launch


def _store_here(array, index, value):  # ... whose leader is the block itself
    array[index] = value


def _barrier_intrinsic(text, simulated):
    @_simulator_twin(simulated)
    @_intrinsic
    def barrier(typingctx):
        def codegen(context, builder, sig, args):
            _inline_ptx(builder, text, "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen
    return barrier


cluster_arrive_relaxed = _barrier_intrinsic("barrier.cluster.arrive.relaxed;", _nothing)
cluster_wait = _barrier_intrinsic("barrier.cluster.wait;", _block_barrier)
cluster_sync = _barrier_intrinsic("barrier.cluster.arrive.release;\\n\\tbarrier.cluster.wait.acquire;", _block_barrier)


@_simulator_twin(_store_here)
@_intrinsic
def store_to_leader(typingctx, array, index, value):
    """array[index] = value in the shared memory of the cluster's block of rank 0."""
    def codegen(context, builder, sig, args):
        array_type, index_type, value_type = sig.args
        ary = context.make_array(array_type)(context, builder, value=args[0])
        index_v = context.cast(builder, args[1], index_type, types.intp)
        pointer = _cgutils.get_item_pointer(context, builder, array_type, ary, [index_v], wraparound=False)
        local = _shared_address(context, builder, pointer)
        leader = _ir.Constant(_ir.IntType(32), 0)
        _inline_ptx(builder, "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1; "
                    "st.shared::cluster.f32 [remote], $2; }", "r,r,f,~{memory}", [local, leader, args[2]])
        return context.get_dummy_value()
    return types.void(array, index, types.float32), codegen
'''

E8, E12, E16 = " " * 8, " " * 12, " " * 16
MERGE_START = E8 + "# Publish the partials GPU-wide, then count this block in; the last of the KV head's\n"
MERGE_END = "\n    return decode_attention\n"
CLUSTER_MERGE = '''        if cluster_active:
            cluster_sync()  # the cluster's partials are in its leader's shared memory
        if not cluster_active or rank != 0:
            return
        # The leader merges its cluster's splits with pages.
        in_cluster = min(CLUSTER, active - cluster_index * CLUSTER)
        for o in range(tid, GROUP * head_dim, THREADS):
            row, dim = o // head_dim, o % head_dim
            merged_max = NEG_INF
            for r in range(in_cluster):
                merged_max = max(merged_max, floats[C_MAX + r * GROUP + row])
            value, total = ZERO, ZERO
            for r in range(in_cluster):
                weight = math.exp2(floats[C_MAX + r * GROUP + row] - merged_max)
                value += floats[C_ACC + (r * GROUP + row) * head_dim + dim] * weight
                total += floats[C_SUM + r * GROUP + row] * weight
            head = kv_head * GROUP + row
            if active_clusters == 1:
                out[head * head_dim + dim] = value / total
            else:
                slot = head * NUM_CLUSTERS + cluster_index
                part_acc[slot * head_dim + dim] = value
                if dim == 0:
                    part_max[slot] = merged_max
                    part_sum[slot] = total
        if active_clusters == 1:
            return
        # Several clusters have pages (longer contexts): their leaders meet through global memory as
        # the product's blocks do, over active_clusters partials.
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == active_clusters - 1
        cuda.syncthreads()
        if last_block[0] == 0:
            return
        cuda.threadfence()
        if tid == 0:
            arrivals[kv_head] = 0  # every leader of this launch has counted; ready for the next
        for o in range(tid, GROUP * head_dim, THREADS):
            row, dim = o // head_dim, o % head_dim
            head = kv_head * GROUP + row
            merged_max = NEG_INF
            for c in range(active_clusters):
                merged_max = max(merged_max, ld_global_cg_f32(part_max, head * NUM_CLUSTERS + c))
            value, total = ZERO, ZERO
            for c in range(active_clusters):
                slot = head * NUM_CLUSTERS + c
                weight = math.exp2(ld_global_cg_f32(part_max, slot) - merged_max)
                value += ld_global_cg_f32(part_acc, slot * head_dim + dim) * weight
                total += ld_global_cg_f32(part_sum, slot) * weight
            out[head * head_dim + dim] = value / total
'''
EDITS = [
    # the split's partial goes into the cluster leader's shared memory (slot: this block's rank)
    (E8 + "if num_pages > 0:\n" + E12 + "if tid < GROUP:\n",
     E8 + "rank = split % CLUSTER\n" + E8 + "if cluster_active:\n"
     + E12 + "cluster_wait()  # (its arrive came before griddepcontrol.wait) every block of the cluster runs\n"
     + E8 + "if num_pages > 0 and cluster_active:\n" + E12 + "if tid < GROUP:\n"),
    (E16 + "slot = (kv_head * GROUP + tid) * num_splits + split\n"
     + E16 + "part_max[slot] = merged_max\n" + E16 + "part_sum[slot] = total\n",
     E16 + "store_to_leader(floats, C_MAX + rank * GROUP + tid, merged_max)\n"
     + E16 + "store_to_leader(floats, C_SUM + rank * GROUP + tid, total)\n"),
    (E16 + "part_acc[((kv_head * GROUP + row) * num_splits + split) * head_dim + dim] = value\n",
     E16 + "store_to_leader(floats, C_ACC + (rank * GROUP + row) * head_dim + dim, value)\n"),
    # the cluster's own region of shared memory, past the product's layout
    ("    P_ACC, P_MAX, P_SUM = layout[\"partial_acc\"], layout[\"partial_max\"], layout[\"partial_sum\"]\n",
     "    P_ACC, P_MAX, P_SUM = layout[\"partial_acc\"], layout[\"partial_max\"], layout[\"partial_sum\"]\n"
     "    C_ACC = layout[\"bytes\"] // 4  # the leader's slots: CLUSTER partials of GROUP heads\n"
     "    C_MAX = C_ACC + CLUSTER * GROUP * head_dim\n"
     "    C_SUM = C_MAX + CLUSTER * GROUP\n"
     "    NUM_CLUSTERS = num_splits // CLUSTER\n"),
    # which clusters have pages, known from pos before the wait; theirs arrive at once
    (E8 + "if warp == PRODUCER_WARP:\n" + E12 + "for i in range(early):\n",
     E8 + "active = (pages_used + pages_per_split - 1) // pages_per_split  # splits with pages\n"
     + E8 + "active_clusters = (active + CLUSTER - 1) // CLUSTER\n"
     + E8 + "cluster_index = split // CLUSTER\n"
     + E8 + "cluster_active = cluster_index < active_clusters\n"
     + E8 + "if cluster_active:\n" + E12 + "cluster_arrive_relaxed()\n"
     + E8 + "if warp == PRODUCER_WARP:\n" + E12 + "for i in range(early):\n"),
    # the launcher: the cluster's region, and clusters of 1 x CLUSTER blocks
    ("                                          consumers)[\"bytes\"]\n",
     "                                          consumers)[\"bytes\"] \\\n"
     "            + 4 * CLUSTER * (num_heads // num_kv_heads) * (head_dim + 2)\n"),
    ("self.arrivals), shared_bytes=self.shared_bytes)", "self.arrivals), shared_bytes=self.shared_bytes, cluster=CLUSTER_SHAPE)"),
]


def variant_source(cluster: int = CLUSTER) -> str:
    return edited_kernel_source("attention_cluster_merge", INTRINSICS % cluster, EDITS,
                                [(MERGE_START, MERGE_END, CLUSTER_MERGE)])


def load_variant(cluster: int = CLUSTER):
    """The variant as a module; clusters of `cluster` blocks (1 in the simulator, which has no clusters:
    tests/sim/test_attention_sim.py checks its merge paths that way)."""
    return load_source(variant_source(cluster), "attention_cluster_merge_kernel")


def builders() -> dict:
    """name -> build(max_pages): the product's kernel and the variant."""
    return {"product": seven_b_attention(),
            "cluster merge": seven_b_attention(load_variant(), num_splits=NUM_SPLITS)}


def check(rng):
    """At contexts that leave one cluster with pages, several, and a partial page; each launched
    twice, so the second finds the counters the first one reset."""
    return check_decode_attention(builders(), (1, 16, 17, 128, 129, 512, 513, 1024, 4096, 32768), rng, launches=2)


def timings() -> list[dict]:
    return time_decode_attention(builders(), (16, 512, 1024, 4096, 32000))


def compile_targets():
    """The variant at 7B shapes, for tests/test_dev_variants.py's compile check."""
    name = f"decode_attention cluster merge[{NUM_SPLITS} splits, cluster {CLUSTER}]"
    return [variant_compile_target(load_variant(), name, None, NUM_SPLITS, drop=("ld.global.cg.v4.f32",),  # its merge reads 4 bytes
                                   add=("barrier.cluster.arrive.release", "mapa.shared::cluster.u32",
                                        "st.shared::cluster.f32"))]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode attention: partials merged in a cluster against through global memory")
