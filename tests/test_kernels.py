"""CPU weight kernels (pyspec._core.kernels).

- quantize/dequantize agree bit for bit with the gguf package (ggml's reference rounding);
- activation rows are quantized exactly as llama.cpp's CPU backend does (Q8_0 / Q8_1);
- matmul equals an independent numpy emulation of the documented reduction order (quants.h) bit
  for bit, equals the C++ scalar reference bit for bit, and is batch invariant (design.md
  invariant 7): a row's result does not depend on M, its position, or the thread count;
- results stay within the activation quantization error of a float64 product;
- the AVX-512, AVX2 and scalar builds of the kernels give the same bits (tests/cpp/kernel_paths.cpp).
"""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyspec._core import kernels

QTYPES = ["Q8_0", "Q4_0", "Q4_1"]
FTYPES = ["F32", "F16", "BF16"]
ALL_TYPES = FTYPES + QTYPES
GGML = {name: gguf.GGMLQuantizationType[name] for name in ALL_TYPES}

# Activation blocks as the kernels lay them out (quants.h).
ACT_Q8_0 = np.dtype([("d", "<f4"), ("sum", "<i4"), ("qs", "i1", (32,))])
ACT_Q8_1 = np.dtype([("d", "<f4"), ("s", "<f4"), ("qs", "i1", (32,))])
WEIGHT_BLOCKS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
}


def rng_for(*key):
    return np.random.default_rng(abs(hash(key)) % (2**32))


def random_rows(rng, rows, n, scale=1.0):
    """Normal values with per-row scales over several decades and a few outliers."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x *= (scale * 10.0 ** rng.uniform(-2, 2, size=(rows, 1))).astype(np.float32)
    x[rng.random((rows, n)) < 0.01] *= 20
    return x


def ggml_quantize(dtype, x):
    with np.errstate(over="ignore"):  # F16 and fp16 scales overflow to inf on purpose in some tests
        return np.asarray(gguf.quants.quantize(x, GGML[dtype])).view(np.uint8).reshape(-1)


def pack(dtype, w):
    return np.concatenate([kernels.quantize(dtype, row) for row in w])


def dequant_rows(dtype, packed, n_rows, n_cols):
    return np.stack([kernels.dequantize(dtype, r, n_cols) for r in packed.reshape(n_rows, -1)])


# ---- exact float32 arithmetic in numpy ---------------------------------------------------------


def fma32(a, b, c):
    """Correctly rounded float32 fma(a, b, c), elementwise: the float64 product of two float32
    values is exact; the float64 sum is made round-to-odd (TwoSum gives its exact error), and
    rounding that to float32 is then correct (53 >= 24 + 2 bits)."""
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    even = (s.view(np.int64) & 1) == 0
    fix = (err != 0) & even
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def test_fma32_emulation_is_exact_on_known_cases():
    # 1 + 2^-24 is a tie in float32; its float64 sum is exact, so plain rounding gives 1.0 (even).
    assert fma32(1.0, 1.0, 2.0**-24) == np.float32(1.0)
    # A tiny extra term breaks the tie upwards: only a fused (single-rounding) fma sees it.
    a = np.float32(1 + 2.0**-23)
    b = np.float32(1 + 2.0**-23)
    c = np.float32(-1.0)
    assert fma32(a, b, c) == np.float32(2.0**-22 + 2.0**-46)
    # Double rounding trap: a*b + c = (float32 tie) - 2^-70. Rounding the float64 sum lands on the
    # tie, which then rounds to even (up); the correctly rounded fma rounds down.
    a = np.float32(2.0**-12 * (1 + 2.0**-23))
    b = np.float32(2.0**-12 * (1 - 2.0**-23))
    c = np.float32(1 + 2.0**-23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2.0**-22)
    assert fma32(a, b, c) == c


# ---- independent emulation of the documented reduction order ---------------------------------


def emulate_activation(dtype, x):
    """llama.cpp's CPU activation quantization (x86 quantize_row_q8_0 / q8_1): per block of 32,
    d = amax / 127 stored as fp16, q = round-half-even(x * (127 / amax)), s = fp16(d * sum(q))."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    qs = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int8)  # rint: ties to even
    sums = qs.astype(np.int32).sum(axis=-1)
    if dtype == "Q4_1":
        out = np.zeros(len(b), ACT_Q8_1)
        out["s"] = (d * sums.astype(np.float32)).astype(np.float16).astype(np.float32)
    else:
        out = np.zeros(len(b), ACT_Q8_0)
        out["sum"] = sums
    out["d"] = d.astype(np.float16).astype(np.float32)
    out["qs"] = qs
    return out


def weight_ints(dtype, packed, n_rows):
    blocks = packed.view(WEIGHT_BLOCKS[dtype]).reshape(n_rows, -1)
    if dtype == "Q8_0":
        q = blocks["qs"].astype(np.int64)
    else:
        q = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=-1).astype(np.int64)
        if dtype == "Q4_0":
            q -= 8
    return blocks, q


def emulate_matmul(dtype, packed, n_rows, n_cols, x):
    m = x.shape[0]
    if dtype in QTYPES:
        acts = np.stack([emulate_activation(dtype, row) for row in x])  # [M, nb]
        blocks, wq = weight_ints(dtype, packed, n_rows)  # wq [N, nb, 32]
        isum = np.einsum("nbj,mbj->mnb", wq, acts["qs"].astype(np.int64)).astype(np.float32)
        dw = blocks["d"].astype(np.float32)
        dd = (dw[None, :, :] * acts["d"][:, None, :]).astype(np.float32)  # [M, N, nb]
        y = np.zeros((m, n_rows), np.float32)
        for b in range(n_cols // 32):
            y = fma32(dd[:, :, b], isum[:, :, b], y)
            if dtype == "Q4_1":
                y = fma32(blocks["m"][None, :, b].astype(np.float32), acts["s"][:, None, b], y)
        return y
    w = dequant_rows(dtype, packed, n_rows, n_cols)
    padded = -(-n_cols // 32) * 32
    wp = np.zeros((n_rows, padded), np.float32)
    xp = np.zeros((m, padded), np.float32)
    wp[:, :n_cols] = w
    xp[:, :n_cols] = x
    p = np.zeros((m, n_rows, 32), np.float32)
    for k in range(0, padded, 32):
        p = fma32(wp[None, :, k : k + 32], xp[:, None, k : k + 32], p)
    for half in (16, 8, 4, 2):
        p = (p[..., :half] + p[..., half : 2 * half]).astype(np.float32)
    return (p[..., 0] + p[..., 1]).astype(np.float32)


# ---- quantize / dequantize ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_TYPES)
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
def test_quantize_matches_gguf_bit_for_bit(dtype, scale):
    rng = rng_for("quantize", dtype, scale)
    x = random_rows(rng, 1, 32 * 200, scale)[0]
    x[:32] = 0.0  # an all-zero block (d = 0)
    x[32:64] = 1.5  # a constant block (Q4_1: d = 0)
    x[64:96] = -x[64:96]
    ours = kernels.quantize(dtype, x)
    ref = ggml_quantize(dtype, x)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("dtype", QTYPES)
def test_quantize_rounds_ties_like_ggml(dtype):
    # Values that land exactly on .5 after scaling: Q8_0 rounds half away from zero, Q4_* truncate
    # x * id + 8.5 / + 0.5. amax = 127 (Q8_0) or 8 (Q4_0) or range 15 (Q4_1) makes id exact.
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5] * 3 + [0.0] * 7, np.float32)
    block = np.concatenate([ties, [{"Q8_0": 127.0, "Q4_0": -8.0, "Q4_1": 7.5}[dtype]]]).astype(np.float32)
    if dtype == "Q4_1":
        block = np.clip(block, -7.5, 7.5)
        block[0] = -7.5
    np.testing.assert_array_equal(kernels.quantize(dtype, block), ggml_quantize(dtype, block))


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_dequantize_matches_gguf_exactly(dtype):
    rng = rng_for("dequantize", dtype)
    n = 32 * 64
    if dtype in QTYPES:
        raw = rng.integers(0, 256, size=n // 32 * WEIGHT_BLOCKS[dtype].itemsize, dtype=np.uint8)
        blocks = raw.view(WEIGHT_BLOCKS[dtype])
        blocks["d"] = rng.standard_normal(n // 32).astype(np.float16)  # finite scales
        if dtype == "Q4_1":
            blocks["m"] = rng.standard_normal(n // 32).astype(np.float16)
        raw = blocks.view(np.uint8)
    else:
        raw = ggml_quantize(dtype, random_rows(rng, 1, n)[0])
    ours = kernels.dequantize(dtype, raw, n)
    ref = gguf.quants.dequantize(raw.view(np.float32) if dtype == "F32" else raw, GGML[dtype]).reshape(-1)
    np.testing.assert_array_equal(ours, ref)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError):
        kernels.quantize("Q4_1", np.zeros(33, np.float32))
    with pytest.raises(ValueError):
        kernels.quantize("Q5_K", np.zeros(32, np.float32))
    with pytest.raises(ValueError):
        kernels.dequantize("Q8_0", np.zeros(33, np.uint8), 32)


# ---- activations ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QTYPES)
def test_activation_rows_are_quantized_like_llama_cpp(dtype):
    rng = rng_for("act", dtype)
    rows = list(random_rows(rng, 8, 576)) + [np.zeros(576, np.float32), np.full(576, 1e-30, np.float32)]
    ties = np.tile(np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], np.float32), 4)  # id = 1: exact .5s
    rows.append(np.tile(ties, 18))
    for x in rows:
        want = emulate_activation(dtype, x)
        fast = kernels.prepare_activation(dtype, x)
        slow = kernels.prepare_activation(dtype, x, reference=True)
        np.testing.assert_array_equal(fast, slow)
        np.testing.assert_array_equal(fast, want.view(np.uint8))
    # Ties go to even, unlike the weight quantizer's half away from zero.
    assert kernels.prepare_activation(dtype, rows[-1]).view(want.dtype)["qs"][0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


# ---- matmul -----------------------------------------------------------------------------------


def make_problem(dtype, n_rows, n_cols, m, seed):
    rng = rng_for("problem", dtype, n_rows, n_cols, m, seed)
    w = random_rows(rng, n_rows, n_cols, 0.05)
    x = random_rows(rng, m, n_cols)
    return pack(dtype, w), x


SHAPES = [(1, 32, 1), (5, 64, 3), (16, 96, 4), (17, 576, 7), (40, 192, 9), (33, 1536, 2)]
FLOAT_ONLY_SHAPES = [(3, 7, 2), (9, 40, 5), (18, 100, 4)]  # K not a multiple of 32


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_matmul_equals_emulated_reduction_order(dtype):
    shapes = SHAPES + (FLOAT_ONLY_SHAPES if dtype in FTYPES else [])
    for n_rows, n_cols, m in shapes:
        w, x = make_problem(dtype, n_rows, n_cols, m, 0)
        want = emulate_matmul(dtype, w, n_rows, n_cols, x)
        ref = kernels.matmul_reference(dtype, w, n_rows, n_cols, x)
        np.testing.assert_array_equal(ref, want, err_msg=f"reference {dtype} {n_rows}x{n_cols} M={m}")
        for threads in (1, 2, 3):
            got = kernels.matmul(dtype, w, n_rows, n_cols, x, threads)
            np.testing.assert_array_equal(got, want, err_msg=f"{dtype} {n_rows}x{n_cols} M={m} threads={threads}")


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_matmul_is_batch_invariant(dtype):
    n_rows, n_cols = 50, 576  # 3 full panels of 16 and a partial one
    w, x = make_problem(dtype, n_rows, n_cols, 64, 1)
    probe = x[5]
    alone = kernels.matmul(dtype, w, n_rows, n_cols, probe[None, :], 1)[0]
    for m, pos in [(7, 0), (7, 6), (64, 5), (64, 63), (3, 2), (513, 300)]:
        rng = rng_for("batch", dtype, m, pos)
        batch = random_rows(rng, m, n_cols)
        batch[pos] = probe
        for threads in (1, 2):
            got = kernels.matmul(dtype, w, n_rows, n_cols, batch, threads)
            np.testing.assert_array_equal(got[pos], alone, err_msg=f"{dtype} M={m} pos={pos} threads={threads}")


def activation_error_bound(dtype, packed, n_rows, n_cols, x):
    """A bound on |matmul - float64 product| that Q8 activations allow: per element,
    |x_hat - x| <= d/2 + 2^-11 |x_hat| (d = block amax / 127, stored in fp16); for Q4_1 the
    offset term uses s = fp16(d * sum(q)) instead of the sum of the values."""
    eps = 2.0**-11
    xb = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, 32)
    d = xb.max(axis=-1, keepdims=True) / 127
    per_value = d / 2 * (1 + eps) + eps * xb  # [M, nb, 32]
    blocks, wq = weight_ints(dtype, packed, n_rows)
    wscaled = np.abs(blocks["d"].astype(np.float64)[..., None] * wq)  # [N, nb, 32]
    bound = np.einsum("nbj,mbj->mn", wscaled, per_value)
    if dtype == "Q4_1":
        per_block = 16 * d[..., 0] * (1 + eps) + eps * xb.sum(axis=-1)
        bound += per_block @ np.abs(blocks["m"].astype(np.float64)).T
    return bound


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_matmul_is_close_to_float64(dtype):
    n_rows, n_cols, m = 64, 576, 6
    w, x = make_problem(dtype, n_rows, n_cols, m, 2)
    wd = dequant_rows(dtype, w, n_rows, n_cols).astype(np.float64)
    exact = x.astype(np.float64) @ wd.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T  # sum of |terms| per output
    got = kernels.matmul(dtype, w, n_rows, n_cols, x, 2)
    rounding = 1e-5 * scale  # float32 accumulation over at most a few hundred steps
    if dtype in FTYPES:
        assert np.all(np.abs(got - exact) <= rounding)
        return
    bound = activation_error_bound(dtype, w, n_rows, n_cols, x)
    assert np.all(np.abs(got - exact) <= bound + rounding)
    # The bound itself is tight enough to mean something (Q4_1's is looser: its offset term
    # bounds a sum of 32 rounding errors by 16 d).
    assert np.median(bound / scale) < (0.25 if dtype == "Q4_1" else 0.05)


def test_matmul_handles_empty_and_rejects_bad_shapes():
    w, x = make_problem("Q4_1", 16, 64, 2, 3)
    assert kernels.matmul("Q4_1", w, 16, 64, x[:0], 2).shape == (0, 16)
    assert kernels.matmul("Q4_1", w[:0], 0, 64, x, 2).shape == (2, 0)
    for dtype in ("Q4_1", "F16"):  # K = 0: empty dot products are +0
        y = kernels.matmul(dtype, np.zeros(0, np.uint8), 3, 0, np.zeros((2, 0), np.float32), 2)
        assert y.shape == (2, 3) and not np.signbit(y).any() and not y.any()
    with pytest.raises(ValueError):
        kernels.matmul("Q4_1", w, 16, 64, np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError):
        kernels.matmul("Q4_1", w[:-1], 16, 64, x)
    with pytest.raises(ValueError):
        kernels.matmul("Q4_1", w, 16, 64, x, 0)


# ---- F16 KV-cache helpers -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 31, 64, 100, 128])
def test_half_dots_follow_the_float_reduction_order(n):
    rng = rng_for("dot", n)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    a16 = a.astype(np.float16)
    want16 = emulate_matmul("F16", a16.view(np.uint8), 1, n, b[None, :])[0, 0]
    assert kernels.dot_f16_f32(a16, b) == want16
    assert kernels.dot_f16_f32(a16.view(np.uint16), b) == want16
    want32 = emulate_matmul("F32", a.view(np.uint8), 1, n, b[None, :])[0, 0]
    assert kernels.dot_f32(a, b) == want32


@pytest.mark.parametrize("n", [1, 15, 64, 130])
def test_axpy_is_an_elementwise_fma(n):
    rng = rng_for("axpy", n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    alpha = np.float32(0.37)
    x16 = x.astype(np.float16)
    np.testing.assert_array_equal(kernels.axpy_f16(alpha, x16, y), fma32(alpha, x16.astype(np.float32), y))
    np.testing.assert_array_equal(kernels.axpy_f32(alpha, x, y), fma32(alpha, x, y))


# ---- every instruction set gives the same bits -------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# name: (flags, the CPU flags (/proc/cpuinfo) it needs to run; built everywhere)
ISA_BUILDS = {
    "native": ("-march=native", ()),
    "x86-64-v3": ("-march=x86-64-v3", ()),
    "x86-64": ("-march=x86-64", ()),
    # the AVX2 kernels with 256-bit VNNI: EVEX-encoded (AVX-512 VNNI + VL, no AVX512BW) ...
    "x86-64-v3+vnni": ("-march=x86-64-v3 -mavx512vl -mavx512vnni", ("avx512vl", "avx512_vnni")),
    # ... and VEX-encoded AVX-VNNI, Intel's client cores (built here; run where the CPU has it)
    "alderlake": ("-march=alderlake", ("avx_vnni",)),
}
ISA_NAMES = {"x86-64-v3": "avx2", "x86-64": "scalar", "x86-64-v3+vnni": "avx2+vnni", "alderlake": "avx2+vnni"}


def cpu_flags():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), []))


def test_kernel_paths_agree_across_instruction_sets(tmp_path):
    """Builds tests/cpp/kernel_paths.cpp for AVX-512 (this CPU), AVX2 with and without 256-bit VNNI
    and plain x86-64; each build that this CPU can run checks its vector kernels against the scalar
    definitions and prints a digest of all results, which must be one and the same."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler on x86-64")
    sources = [ROOT / "tests/cpp/kernel_paths.cpp"] + [ROOT / "csrc" / f for f in
                                                        ("cpu/quant_rows.cpp", "cpu/dot_reference.cpp", "cpu/dot_float.cpp",
                                                         "cpu/dot_quant.cpp", "cpu/matmul.cpp", "core/thread_pool.cpp")]
    builds = {}
    have = cpu_flags()
    for name, (flags, needs) in ISA_BUILDS.items():
        exe = tmp_path / name
        cmd = [cxx, "-std=c++17", "-O1", *flags.split(), f"-I{ROOT / 'csrc'}", *map(str, sources), "-o", str(exe),
               "-pthread"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        builds[name] = (exe, proc, set(needs) <= have)
    digests = {}
    for name, (exe, proc, runs_here) in builds.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} build failed:\n{out}"
        if not runs_here:
            continue
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}"
        digest, isa = run.stdout.strip().split(maxsplit=1)
        digests[name] = (isa, digest)
    assert digests["native"][0] == kernels.isa()
    for name, isa in ISA_NAMES.items():
        assert name not in digests or digests[name][0] == isa, digests
    assert len({d for _, d in digests.values()}) == 1, digests
