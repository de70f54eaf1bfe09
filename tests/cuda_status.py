"""Whether the GPU tests can run here, shared by tests/test_cuda_*.py.

CI has no GPU: the tests marked `gpu` skip with the reason `_core.cuda_available()` gives.
PYSPEC_TEST_DEVICE_BACKEND=cpu runs them with the CPU standing in for the device, which checks
the tests themselves.
"""

import os

import pytest

from pyspec import _core


def _cuda_status():
    probe = getattr(_core, "cuda_available", None)
    if probe is None:
        return False, "pyspec._core predates the CUDA backend (no cuda_available)"
    ok, reason = probe()
    return bool(ok), str(reason)


CUDA_OK, CUDA_REASON = _cuda_status()
DEVICE = os.environ.get("PYSPEC_TEST_DEVICE_BACKEND", "cuda")
gpu = pytest.mark.skipif(not (CUDA_OK or DEVICE == "cpu"),
                         reason=f"CUDA backend not available: {CUDA_REASON}")
real_gpu = pytest.mark.skipif(not CUDA_OK, reason=f"CUDA backend not available: {CUDA_REASON}")
no_cuda = pytest.mark.skipif(CUDA_OK, reason="CUDA is available here")


def rows_on_the_balanced_grid():
    """Whether one-column MUL_MATs of long 16-bit rows take the balanced row grid here (the CUDA
    backend, unless the environment sends those rows elsewhere)."""
    return DEVICE == "cuda" and all(
        os.environ.get(v) != off for v, off in (("PYSPEC_CUDA_ROW_STREAM", "0"), ("PYSPEC_CUDA_ROW_TMA", "1"),
                                                ("PYSPEC_CUDA_ROW_BALANCE", "0")))
