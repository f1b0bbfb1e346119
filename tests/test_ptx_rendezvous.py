"""The simulator's waits (ptx/rendezvous.py): a slow lane is waited for however long it takes, a
block where every thread waits is reported as a deadlock naming the missing lanes, a divergent lane
is caught, and an aborted block lets its waiting threads go at once.

The threads here stand in for the simulator's: each carries the `_manager` (its block) and
`thread_id` that numba-cuda's BlockThread has, and a lane "at syncthreads" sets its
`syncthreads_blocked` as the simulator's syncthreads does.
"""

from __future__ import annotations

import threading
import time

import pytest

from pynanoqwen.ptx import rendezvous
from pynanoqwen.ptx.rendezvous import cooperate


class _Block:
    _block_dim = (2, 1, 1)


def _lane(block, lane, body):
    """A started thread that runs body() as lane `lane` of `block`; its outcome lands in .outcome."""
    def run():
        try:
            thread.outcome = body()
        except Exception as error:  # the test inspects it
            thread.outcome = error

    thread = threading.Thread(target=run, daemon=True)
    thread._manager, thread.thread_id, thread.outcome = block, lane, None
    thread.syncthreads_blocked = False
    thread.abort = False
    thread.start()
    return thread


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(rendezvous, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(rendezvous, "STUCK_SECONDS", 0.2)


def _exchange_lanes(lanes):
    return [lanes[1], lanes[0]]


def test_a_slow_lane_is_waited_for_past_the_deadlock_limit(quick):
    """Lane 1 keeps running for five times STUCK_SECONDS before it arrives: not a deadlock."""
    block = _Block()
    first = _lane(block, 0, lambda: cooperate("shfl", "from 0", _exchange_lanes, partial=True))
    time.sleep(0.05)

    def slow():
        deadline = time.monotonic() + 5 * rendezvous.STUCK_SECONDS
        while time.monotonic() < deadline:  # running, not waiting
            pass
        return cooperate("shfl", "from 1", _exchange_lanes, partial=True)

    second = _lane(block, 1, slow)
    first.join(10)
    second.join(10)
    assert (first.outcome, second.outcome) == ("from 1", "from 0")


def test_a_block_whose_threads_all_wait_is_a_deadlock_naming_the_missing_lane(quick):
    """Lane 1 sits at syncthreads while lane 0 waits for it at a shuffle: no thread can move."""
    block = _Block()
    release = threading.Event()

    def at_syncthreads():
        threading.current_thread().syncthreads_blocked = True
        release.wait(10)

    second = _lane(block, 1, at_syncthreads)
    started = time.monotonic()
    first = _lane(block, 0, lambda: cooperate("shfl", 0, _exchange_lanes, partial=True))
    first.join(10)
    release.set()
    second.join(10)
    assert isinstance(first.outcome, RuntimeError)
    assert "shfl: lane 0 of 2 waits; lanes [1] never arrived: deadlock" in str(first.outcome)
    assert time.monotonic() - started < 5


def test_a_lane_at_another_instruction_has_diverged(quick):
    block = _Block()
    first = _lane(block, 0, lambda: cooperate("shfl", 0, _exchange_lanes, partial=True))
    time.sleep(0.05)
    second = _lane(block, 1, lambda: cooperate("mma.sync", 0, _exchange_lanes, partial=True))
    second.join(10)
    first.abort = True  # what the simulator does once a thread of the block has raised
    first.join(10)
    assert "mma.sync: lane 1 diverged; other lanes of its group are at shfl" in str(second.outcome)
    assert "the block was aborted" in str(first.outcome)


def test_an_aborted_block_releases_its_waiting_thread_at_once(monkeypatch):
    monkeypatch.setattr(rendezvous, "POLL_SECONDS", 0.01)  # STUCK_SECONDS keeps its real value
    block = _Block()
    first = _lane(block, 0, lambda: cooperate("shfl", 0, _exchange_lanes, partial=True))
    time.sleep(0.05)
    first.abort = True
    first.join(rendezvous.STUCK_SECONDS / 2)
    assert not first.is_alive() and "the block was aborted" in str(first.outcome)


def test_a_group_the_block_cannot_fill_raises_unless_partial():
    block = _Block()
    lone = _lane(block, 0, lambda: cooperate("mma.sync", 0, lambda lanes: lanes, width=32))
    lone.join(10)
    assert "mma.sync: group 0 has 2 threads; all 32 must take part" in str(lone.outcome)
