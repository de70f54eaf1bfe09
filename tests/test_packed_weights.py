"""The CPU's packed weights (cpu/quants.h pack_weights, core/immutable_memory.h): quantized weights
read from a GGUF mapping are rearranged once into contiguous 16-row panel blocks, and every matmul
over them gives the bits the file layout gives. Packing changes where bytes are read from, never
which values meet in what order, so these tests compare bit patterns, not tolerances."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyspec
from pyspec._core import kernels

from default_model import require_default_model

# The child processes import the pyspec this process imported (an in-place build, or the
# installed package as CI has it).
PYSPEC_HOME = str(Path(pyspec.__file__).resolve().parents[1])
TYPES = ("Q8_0", "Q4_0", "Q4_1")


def needs_packing(dtype):
    if not kernels.weights_packable(dtype):
        pytest.skip(f"this build has no packed layout for {dtype} (AVX-512 VNNI builds only)")


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("shape", [(1, 32), (15, 64), (16, 576), (17, 96), (40, 160), (193, 1536)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_matmul_gives_the_file_layouts_bits(dtype, shape):
    """Every row count (partial last panels: the packed copy repeats the last row as the strided
    kernel reads it, and stores none of it), activation rows from 1 to 40 (one tile, the tiles'
    rest, the cached path of several tiles), one and two threads (the threads' row shares start at
    panel boundaries)."""
    needs_packing(dtype)
    n_rows, k = shape
    rng = np.random.default_rng(n_rows * 7 + k)
    w = np.concatenate([kernels.quantize(dtype, row) for row in (rng.standard_normal((n_rows, k)) * 0.05).astype(np.float32)])
    for m in (1, 2, 3, 4, 5, 9, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        for threads in (1, 2):
            plain = kernels.matmul(dtype, w, n_rows, k, x, threads)
            packed = kernels.matmul(dtype, w, n_rows, k, x, threads, packed=True)
            assert np.array_equal(plain.view(np.uint32), packed.view(np.uint32)), (m, threads)
    # and the scalar reference agrees (the strided kernel is held to it elsewhere)
    x = rng.standard_normal((3, k)).astype(np.float32)
    ref = kernels.matmul_reference(dtype, w, n_rows, k, x)
    assert np.array_equal(ref.view(np.uint32), kernels.matmul(dtype, w, n_rows, k, x, 2, packed=True).view(np.uint32))


def test_a_type_without_a_packed_layout_is_refused():
    w = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="no packed layout for F16"):
        kernels.matmul("F16", w, 1, 32, np.zeros((1, 32), np.float32), 1, packed=True)


_LOGITS_SCRIPT = """
import hashlib, sys
import numpy as np
sys.path.insert(0, {root!r})
import pyspec
from pyspec._core import kernels
model = pyspec.Model(n_threads=2)
ctx = pyspec.Context(model, n_ctx=256, n_seq_max=1, n_batch=64)
ids = np.arange(100, 140, dtype=np.int32)
rows = ctx.decode(ids, output=np.ones(ids.size, bool)).logits      # a batch of 40 rows
one = ctx.decode([7], output=np.ones(1, bool)).logits                # a decode row
three = ctx.decode([8, 9, 10], output=np.ones(3, bool)).logits       # a verify pass
h = hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() for a in (rows, one, three))).hexdigest()
print(h, kernels.packed_copy_stats()["copies"])
"""


def test_the_default_model_gives_the_same_logits_packed_and_not():
    """The embedded SmolLM2 (Q4_1 matrices, Q8_0 output head) in two processes, PYSPEC_CPU_PACK=0
    and the default: the same logits to the bit for a 40-row batch, a decode row and 3 verify
    rows, and only the default kept packed copies (so the comparison covers the packed path)."""
    require_default_model()
    if not kernels.weights_packable("Q4_1"):
        pytest.skip("this build has no packed layout (AVX-512 VNNI builds only)")
    out = {}
    for pack in ("0", "1"):
        env = dict(os.environ, PYSPEC_CPU_PACK=pack)
        res = subprocess.run([sys.executable, "-c", _LOGITS_SCRIPT.format(root=PYSPEC_HOME)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        digest, copies = res.stdout.split()
        out[pack] = (digest, int(copies))
    assert out["0"][0] == out["1"][0]
    assert out["0"][1] == 0 and out["1"][1] > 0, out


def test_packed_copies_live_as_long_as_their_file():
    """The copies are made once per mapped file, shared by a second context, and freed with the
    file (its last Model gone): nothing outlives the mapping it was made from."""
    require_default_model()
    if not kernels.weights_packable("Q4_1") or os.environ.get("PYSPEC_CPU_PACK") == "0":
        pytest.skip("packing is off in this build or this run")
    gc.collect()
    before = kernels.packed_copy_stats()
    model = pyspec.Model(n_threads=2)
    ctx = pyspec.Context(model, n_ctx=128, n_seq_max=1, n_batch=16)
    ctx.decode([1, 2, 3])
    made = kernels.packed_copy_stats()
    assert made["regions"] == before["regions"] + 1
    assert made["copies"] > before["copies"] and made["bytes"] > before["bytes"]
    ctx2 = pyspec.Context(model, n_ctx=128, n_seq_max=1, n_batch=16)
    ctx2.decode([1, 2, 3])
    assert kernels.packed_copy_stats() == made  # shared, not made again
    del ctx, ctx2, model
    gc.collect()
    assert kernels.packed_copy_stats() == before
