"""The kernel variants out of the product (dev/): each compiles for sm_90 without spilling (here,
on the CPU), and on the GPU each passes its float64 check and its timing harness runs, printing
the table docs/PERFORMANCE.md quotes (run with -s):

    python -m pytest -m gpu -s tests/test_dev_variants.py
"""

import re

import numpy as np
import pytest
from numba import cuda

import attention_cluster_merge
import attention_one_fence
import attention_packed_halves
import attention_page_phase
import attention_prefill_kernels_tma
import gemm_k_chunks
import gemm_mma_sync_large
import gemm_wgmma_split_k
import gemm_wgmma_tma
import gemv_bulk_ring
import gemv_group
import gemv_group_verify
import gemv_mma
import megakernel_gemv_chain
import mlp_fused
import unfused_norm
from harness import print_table
from test_kernels_compile import assemble_sm90

VARIANTS = [gemm_mma_sync_large, gemm_wgmma_split_k, gemm_wgmma_tma, gemm_k_chunks, unfused_norm,
            attention_cluster_merge, attention_one_fence, attention_packed_halves, attention_page_phase, mlp_fused, gemv_bulk_ring, gemv_mma, megakernel_gemv_chain, gemv_group,
            gemv_group_verify]
TARGETS = (gemm_mma_sync_large.compile_targets() + gemm_wgmma_split_k.compile_targets() + gemm_k_chunks.compile_targets()
           + gemm_wgmma_tma.compile_targets()
           + attention_cluster_merge.compile_targets() + attention_one_fence.compile_targets()
           + attention_packed_halves.compile_targets() + attention_page_phase.compile_targets()
           + attention_prefill_kernels_tma.compile_targets()
           + mlp_fused.compile_targets() + gemv_bulk_ring.compile_targets() + gemv_mma.compile_targets()
           + megakernel_gemv_chain.compile_targets() + gemv_group.compile_targets()
           + gemv_group_verify.compile_targets())


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_variant_compiles_for_sm90_without_spills(target):
    ptx, _ = cuda.compile_ptx(target.py_func, target.signature, cc=target.cc)
    for instruction in target.must_contain:
        assert instruction in ptx, f"{target.name}: no {instruction}"
    assert ".local" not in ptx
    report = assemble_sm90(ptx, "sm_" + "".join(map(str, target.cc)))
    assert [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)] == [0], report
    for note in ("C7509", "C7519", "C7520"):  # tests/test_kernels_compile.py says what each means
        assert note not in report, f"{target.name}: ptxas serializes or fences its wgmmas ({note}): {report}"


def test_megakernel_stream_holds_each_blocks_rows_as_the_kernel_reads_them():
    """dev/megakernel_gemv_chain.py's weight stream, walked with the producer's offsets and the
    consumers' indices (read_stream), gives back every matrix row of the first, a middle and the
    last block, of both weight sets, exactly."""
    from pynanoqwen.quant import dequantize_int4

    rng = np.random.default_rng(7)
    weights = megakernel_gemv_chain.make_weights(rng)
    stream, bases = megakernel_gemv_chain.pack(weights, 132)
    for set_index, block in ((0, 0), (1, 57), (1, 131)):
        found = megakernel_gemv_chain.read_stream(stream, bases, 132, set_index, block)
        for op in megakernel_gemv_chain.OPS:
            rows = slice(block * op.n // 132, (block + 1) * op.n // 132)
            for (qweight, scales), got in zip(weights[set_index][op.name], found[op.name]):
                assert np.array_equal(dequantize_int4(qweight[rows], scales[rows], np.float64), got), (op.name, block)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_variant_matches_float64_and_is_timed(variant):
    results = variant.check(np.random.default_rng())
    for result in results:
        print(result.line())
    assert results and all(r.status == "PASS" for r in results)
    print_table(variant.__name__, variant.timings())
