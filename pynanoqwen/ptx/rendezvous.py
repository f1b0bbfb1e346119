"""How simulated threads wait for one another (CUDA simulator only).

numba-cuda's simulator runs each CUDA thread as a Python thread and has `syncthreads`, but nothing
for the instructions whose threads cooperate (shuffles and bar.warp.sync in warp.py, mma and
ldmatrix in mma.py, wgmma in wgmma.py) or for mbarrier phases (mbarrier.py). Their twins wait here.

`cooperate`: the threads of one warp (32) or warpgroup (128) meet for one instruction. Each
deposits its operands; the last to arrive computes the whole group's result once and wakes the
others, who take their part. One wait per instruction: results alternate between two buffers, so
a fast lane may already deposit for the next instruction while a slow one still reads this one's
result; that buffer is overwritten only when the instruction after next completes, which needs the
slow lane's deposit first.

`wait_for`: every simulated wait. When is a wait a deadlock? Not when it is long. A simulated block
is up to a few hundred Python threads taking turns at one interpreter lock, and on a loaded 2-core
machine the first lane of a warp to reach a shuffle can wait over a minute for the last one. A fixed
60 s limit failed CI that way, and worse, the threads it left behind still held the kernel module's
`cuda` swapped for the simulator's, so every later test failed with "'FakeCUDAModule' object has no
attribute 'jit'". A wait is a deadlock when no thread of the block can move any more: every live
thread of the block is waiting here or at `syncthreads`, without a break, for STUCK_SECONDS. The
message then names the lanes that never arrived. A wait also ends at once when the simulator aborts
the block because another thread raised, so no thread outlives its kernel.
"""

from __future__ import annotations

import threading
import time

POLL_SECONDS = 0.5  # how often a waiting thread looks at the rest of its block
STUCK_SECONDS = 10.0  # every live thread waiting this long, uninterrupted: nothing can wake them


def _block_threads(thread) -> list:
    """The live simulator threads of `thread`'s block (just `thread` outside a simulated kernel)."""
    manager = getattr(thread, "_manager", None)
    if manager is None:
        return [thread]
    return [t for t in threading.enumerate() if getattr(t, "_manager", None) is manager and t.is_alive()]


def _is_blocked(thread) -> bool:
    return getattr(thread, "_pynanoqwen_waiting", False) or getattr(thread, "syncthreads_blocked", False)


def wait_for(condition: threading.Condition, done, describe) -> None:
    """Wait on `condition` (held by the caller) until done() is true. Raises RuntimeError with
    describe()'s text when the block is deadlocked, or when the simulator has aborted the block."""
    thread = threading.current_thread()
    thread._pynanoqwen_waiting = True
    stuck_since = None
    try:
        while not condition.wait_for(done, timeout=POLL_SECONDS):
            if getattr(thread, "abort", False):
                raise RuntimeError(f"{describe()}: the block was aborted (another thread raised)")
            if all(_is_blocked(t) for t in _block_threads(thread)):
                stuck_since = stuck_since if stuck_since is not None else time.monotonic()
                if time.monotonic() - stuck_since >= STUCK_SECONDS:
                    raise RuntimeError(f"{describe()}: deadlock, every thread of the block has been waiting "
                                       f"{STUCK_SECONDS:.0f} s")
            else:
                stuck_since = None
    finally:
        thread._pynanoqwen_waiting = False


class Rendezvous:
    """Where the `width` threads of one warp or warpgroup meet, one instruction at a time."""

    def __init__(self, width: int):
        self.width = width
        self.ready = threading.Condition()
        self.operands = [None] * width
        self.arrived_in = [-1] * width  # the generation each lane last arrived for (the deadlock message)
        self.results = [None, None]
        self.arrived = 0
        self.generation = 0
        self.instruction = None  # what this generation's first lane executes

    def meet(self, instruction: str, lane: int, operands, compute):
        """This lane's part of compute(every lane's operands); compute runs once, in the last lane."""
        with self.ready:
            generation = self.generation
            if self.arrived == 0:
                self.instruction = instruction
            elif instruction != self.instruction:
                raise RuntimeError(f"{instruction}: lane {lane} diverged; other lanes of its group are at "
                                   f"{self.instruction}")
            self.operands[lane] = operands
            self.arrived_in[lane] = generation
            self.arrived += 1
            if self.arrived == self.width:
                self.results[generation % 2] = compute(self.operands)
                self.arrived = 0
                self.generation += 1
                self.ready.notify_all()
            else:
                def describe():
                    missing = [other for other in range(self.width) if self.arrived_in[other] != generation]
                    return f"{instruction}: lane {lane} of {self.width} waits; lanes {missing} never arrived"

                wait_for(self.ready, lambda: self.generation != generation, describe)
            return self.results[generation % 2][lane]


_groups_lock = threading.Lock()


def cooperate(instruction: str, operands, compute, width: int = 32, partial: bool = False):
    """This thread's part of compute(all the group's operands), computed once per group of `width`
    consecutive threads. A group the block cannot fill raises, unless `partial` (a shuffle on the
    block's last, partial warp: it then has the threads the block has)."""
    thread = threading.current_thread()
    block = thread._manager  # the simulator's BlockManager: a new one runs each block
    group, lane = divmod(thread.thread_id, width)
    with _groups_lock:
        groups = block.__dict__.setdefault(f"_pynanoqwen_rendezvous_{width}", {})
        if group not in groups:
            threads_in_block = 1
            for extent in block._block_dim:
                threads_in_block *= extent
            groups[group] = Rendezvous(min(width, threads_in_block - width * group))
        rendezvous = groups[group]
    if rendezvous.width < width and not partial:
        raise RuntimeError(f"{instruction}: group {group} has {rendezvous.width} threads; all {width} must take part")
    return rendezvous.meet(instruction, lane, operands, compute)
