"""Shared pieces of the CUDA backend's op-level tests (tests/test_cuda_ops.py, test_cuda_matmul.py,
test_cuda_attention.py): the type lists and batch sizes they sweep, and running one graph on the
device and on the CPU.

Without a usable CUDA backend (CI has no GPU) the GPU tests skip with the reason
pyspec._core.cuda_available() gives. PYSPEC_TEST_DEVICE_BACKEND=cpu runs them with the CPU backend
in the device's place, which checks the tests themselves on a machine without a GPU
(tests/cuda_status.py).
"""

from __future__ import annotations

import numpy as np

import test_cpu_ops as cpu  # the CPU tests' helpers, references and op cases
from cuda_status import DEVICE

NEG_INF = -np.inf
BATCHES = [1, 4, 16, 64, 300]
FLOAT_W = cpu.FLOAT_W
QUANT_W = cpu.QUANT_W
ALL_W = FLOAT_W + QUANT_W
CACHE_TYPES = ["F16", "F32"]


def run_on(backend, build):
    """build() -> (graph, feeds, fetch), called afresh for each run: the CPU backend writes
    SET_ROWS into external host arrays, so every run gets its own copies of the feeds."""
    g, feeds, fetch = build()
    feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}
    return cpu.run(g, feeds, fetch, backend=backend)


def dev_and_cpu(build):
    """The fetched tensors on the device and on the CPU (one thread)."""
    return run_on(DEVICE, build), run_on("cpu", build)


def assert_close_bound(got, want, bound, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN fails too
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[:5]
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} outside the bound; got {got.reshape(-1)[i]}, "
                             f"want {np.asarray(want).reshape(-1)[i]}, bound {np.broadcast_to(bound, got.shape).reshape(-1)[i]}")


