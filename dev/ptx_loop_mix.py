"""The PTX instruction mix of each loop of a kernel, counted on the CPU (no GPU needed).

    python dev/ptx_loop_mix.py gate_up_silu_wgmma_128x128
    python dev/ptx_loop_mix.py "residual_wgmma_128x256[down_proj"

The argument selects the compile targets (pynanoqwen.kernels.all_compile_targets, the builds
tests/test_kernels_compile.py checks) whose name contains it. Each is compiled with
numba.cuda.compile_ptx for its compute capability. A loop is a backward branch to a label. For
every loop of more than --min instructions the script prints its length and its most frequent
opcodes. A kernel docstring's count of instructions a weight or a k tile can be checked this way
before a GPU run. PTX is not SASS: ptxas still schedules, folds and expands, so Nsight Compute's
executed-instruction count is the measurement; this says where in the source the instructions
come from.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.kernels import all_compile_targets  # noqa: E402

BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$?L__\w+)$")
LABEL = re.compile(r"(\$?L__\w+):")


def statements(ptx: str) -> list[str]:
    """Labels ("NAME:") and instructions in order. An instruction ends at its ';' (inline-asm
    wgmma spreads its register list over lines); comments, directives and braces are dropped."""
    text = re.sub(r"//[^\n]*", "", ptx)
    items = []
    for piece in text.split(";"):
        piece = " ".join(piece.replace("{", " ").replace("}", " ").split())
        while (label := LABEL.match(piece)) is not None:
            items.append(label.group(0))
            piece = piece[label.end():].strip()
        if piece and not piece.startswith("."):
            items.append(piece)
    return items


def opcode(instruction: str) -> str:
    """The opcode without its type suffixes; a predicated instruction's opcode after its guard."""
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loops(ptx: str) -> list[list[str]]:
    """The instructions of each loop: from a label to a later branch back to it."""
    items = statements(ptx)
    labels = {item[:-1]: i for i, item in enumerate(items) if item.endswith(":")}
    found = []
    for i, item in enumerate(items):
        target = BRANCH.search(item)
        if target and labels.get(target.group(1), i) < i:
            found.append([x for x in items[labels[target.group(1)]:i + 1] if not x.endswith(":")])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a part of the compile target's name")
    parser.add_argument("--min", type=int, default=100, help="skip loops of fewer instructions")
    parser.add_argument("--top", type=int, default=14, help="opcodes to list a loop")
    args = parser.parse_args()
    from numba import cuda

    targets = [t for t in all_compile_targets() if args.name in t.name]
    if not targets:
        raise SystemExit(f"error: no compile target's name contains {args.name!r}")
    for target in targets:
        ptx, _ = cuda.compile_ptx(target.py_func, target.signature, cc=target.cc)
        count = sum(not item.endswith(":") for item in statements(ptx))
        print(f"{target.name}: {count} PTX instructions")
        for body in loops(ptx):
            if len(body) >= args.min:
                mix = collections.Counter(opcode(line) for line in body).most_common(args.top)
                print(f"  a loop of {len(body)}: " + ", ".join(f"{name} {count}" for name, count in mix))


if __name__ == "__main__":
    main()
