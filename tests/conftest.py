"""Shared test setup: `gpu` tests skip cleanly on machines without a CUDA GPU."""

import functools

import pytest


@functools.cache
def gpu_available() -> bool:
    try:
        from numba import cuda

        return cuda.is_available() and cuda.detect() and cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:  # no driver, no device, or the simulator: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA sm_90 GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# tests/sim runs only inside the child process that test_simulator.py starts with the simulator on.
collect_ignore = [] if __import__("os").environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["sim"]
