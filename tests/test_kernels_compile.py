"""Every registered kernel (pynanoqwen.kernels.all_compile_targets) compiles for sm_90, contains
the instructions it is built around, has no `call` if it is on the per-token path, and assembles
for sm_90 without spilling registers. Run with -s to see registers and the hot loop's instructions.

The assembler is nvJitLink's (the one numba-cuda itself uses to load kernels), asked for ptxas'
verbose report: a standalone `ptxas` on PATH may be older than the NVVM that wrote the PTX
(here CUDA 13.0's ptxas rejects the PTX ISA 9.5 that NVVM 13.5 emits).
"""

import collections
import re

import pytest
from numba import cuda

from pynanoqwen.kernels import all_compile_targets

TARGETS = all_compile_targets()


def assemble_sm90(ptx: str, arch: str = "sm_90") -> str:
    """ptxas' verbose report (registers, spills) for the PTX, assembled for sm_90 (or sm_90a) by nvJitLink."""
    nvjitlink = pytest.importorskip("cuda.bindings.nvjitlink")
    handle = nvjitlink.create(3, [f"-arch={arch}", "-O3", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        return log.decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


def instructions(lines) -> collections.Counter:
    """Opcode counts of PTX lines; an inline-asm block `{ ...; ...; }` counts each instruction."""
    counts = collections.Counter()
    for line in lines:
        for statement in line.split("//")[0].strip(" \t{}").split(";"):
            words = statement.split()
            if words and words[0].startswith("@"):  # predicated: @%p1 bra ...
                words = words[1:]
            if words and re.fullmatch(r"[a-z][\w.:]*", words[0]) and not words[0].endswith(":"):
                counts[words[0]] += 1
    return counts


def hottest_loop(ptx: str, markers) -> list[str]:
    """The lines of the basic block (between PTX labels) holding most of the marker instructions."""
    blocks = re.split(r"^\$L__BB\d+_\d+:", ptx, flags=re.M)
    return max(blocks, key=lambda block: sum(block.count(m) for m in markers)).splitlines()


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_kernel_compiles_for_sm90(target):
    ptx, _ = cuda.compile_ptx(target.py_func, target.signature, cc=target.cc)
    body = ptx[ptx.index(".entry"):]
    counts = instructions(body.splitlines())
    for instruction in target.must_contain:
        assert counts[instruction] > 0, f"{target.name}: no {instruction} in its PTX"
    if target.hot:
        assert counts["call"] == 0, f"{target.name}: a hot kernel makes a function call"
    assert ".local" not in ptx, f"{target.name}: uses local memory (an array Numba did not keep in registers)"

    report = assemble_sm90(ptx, "sm_" + "".join(map(str, target.cc)))
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)]
    registers = re.findall(r"Used (\d+) registers", report)
    assert spills and registers, report
    loop = instructions(hottest_loop(body, target.must_contain))
    print(f"\n{target.name}: {registers[0]} registers, {spills[0]} bytes spilled; hot loop "
          f"{sum(loop.values())} PTX instructions: " + ", ".join(f"{n} {op}" for op, n in loop.most_common()))
    assert spills == [0] * len(spills), report
    # ptxas runs every wgmma of a kernel one at a time when the kernel holds a call (C7509): a
    # correctly rounded division is one (docs/HARDWARE.md; kernels/call_free.py divides without it).
    # It does too when a wgmma's registers are written on a divergent path (C7520), and it inserts
    # a warpgroup arrive between wgmmas whose A registers are written between them (C7519).
    for note in ("C7509", "C7519", "C7520"):
        assert note not in report, f"{target.name}: ptxas serializes or fences its wgmmas ({note}): {report}"


def test_sampling_sorts_divide_by_nothing():
    """The candidates kernels' sorting networks step by powers of two known only at run time;
    `t // stride` by one is a 64-bit integer division, tens of instructions beside each
    compare-exchange's few, so they step by shifts (kernels/sampling.py)."""
    sorts = [t for t in TARGETS if t.name.startswith("candidates_")]
    assert sorts
    for target in sorts:
        ptx, _ = cuda.compile_ptx(target.py_func, target.signature, cc=target.cc)
        divisions = re.findall(r"\b(?:div|rem)\.[su]\d+\s", ptx)
        assert not divisions, f"{target.name}: {collections.Counter(divisions)}"
