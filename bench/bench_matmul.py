"""Matmul throughput of pyspec's CPU kernels against ggml's, on SmolLM2-135M's weight shapes.

For each weight type and shape, at M = 1 (decode), 16 (a verify batch) and 512 (a prompt chunk):
GB/s of weights read and GFLOP/s, for pyspec (pyspec._core.kernels) and for ggml (the libggml
shipped in llama-cpp-python, called through ctypes: a graph of mul_mat nodes computed with
ggml_graph_compute_with_ctx). Both read the same packed bytes (pyspec uses ggml's block layout).

Weights are cycled through enough copies to exceed the last-level cache, as in decoding a model
that does not fit in it. Each figure is the best of several trials (shared machines are noisy).

    python bench/bench_matmul.py [--threads 2] [--trials 5] [--all-types]
(with an in-place build, from the repo root: PYTHONPATH=. python bench/bench_matmul.py)
"""

import argparse
import ctypes
import os
import pathlib
import time

import numpy as np

from pyspec._core import kernels

GGML_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (N rows, K cols)
LM_HEAD = ("Q8_0", 49152, 576)
STREAM_BYTES = 160 << 20  # weight copies per measurement: well past a 32 MB L3


class GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few ggml calls needed to time mul_mat."""

    def __init__(self):
        import llama_cpp  # noqa: F401  (locates and loads the shared libraries)

        lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
        mode = getattr(os, "RTLD_GLOBAL", 0)
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)
        b, c = self.base, self.cpu
        b.ggml_init.argtypes, b.ggml_init.restype = [GgmlInitParams], ctypes.c_void_p
        b.ggml_free.argtypes = [ctypes.c_void_p]
        b.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        b.ggml_new_tensor_2d.restype = ctypes.c_void_p
        b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [ctypes.c_void_p] * 3, ctypes.c_void_p
        b.ggml_new_graph_custom.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_bool]
        b.ggml_new_graph_custom.restype = ctypes.c_void_p
        b.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [ctypes.c_void_p], ctypes.c_void_p
        b.ggml_nbytes.argtypes, b.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        c.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        c.ggml_graph_compute_with_ctx.restype = ctypes.c_int

    def time_matmul(self, dtype, packed_copies, n_rows, n_cols, x, threads, nodes):
        """Seconds per mul_mat: one graph of `nodes` mul_mats cycling through the weight copies."""
        b = self.base
        m = x.shape[0]
        copies = len(packed_copies)
        mem = sum(p.nbytes for p in packed_copies) + x.nbytes * 4 + nodes * (m * n_rows * 4 + 1024) + (256 << 20)
        ctx = b.ggml_init(GgmlInitParams(mem, None, False))
        if not ctx:
            raise RuntimeError("ggml_init failed")
        try:
            xt = b.ggml_new_tensor_2d(ctx, GGML_TYPE["F32"], n_cols, m)
            ctypes.memmove(b.ggml_get_data(xt), x.ctypes.data, x.nbytes)
            weights = []
            for p in packed_copies:
                wt = b.ggml_new_tensor_2d(ctx, GGML_TYPE[dtype], n_cols, n_rows)
                assert b.ggml_nbytes(wt) == p.nbytes
                ctypes.memmove(b.ggml_get_data(wt), p.ctypes.data, p.nbytes)
                weights.append(wt)
            graph = b.ggml_new_graph_custom(ctx, max(2048, 2 * nodes), False)
            for i in range(nodes):
                b.ggml_build_forward_expand(graph, b.ggml_mul_mat(ctx, weights[i % copies], xt))
            start = time.perf_counter()
            if self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
                raise RuntimeError("ggml_graph_compute_with_ctx failed")
            return (time.perf_counter() - start) / nodes
        finally:
            b.ggml_free(ctx)


def measure(dtype, n_rows, n_cols, m, args, ggml):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n_rows, n_cols)) * 0.05).astype(np.float32)
    packed = np.concatenate([kernels.quantize(dtype, row) for row in w])
    copies = max(1, min(256, STREAM_BYTES // packed.nbytes))
    if m >= 16:  # the weights are reused within a call; fewer copies keep the run short
        copies = max(1, min(copies, 8))
    stream = np.tile(packed, copies)
    x = rng.standard_normal((m, n_cols)).astype(np.float32)
    flops = 2.0 * m * n_rows * n_cols
    # Enough calls per trial for ~20 ms of work (ggml also builds one node per call).
    est = kernels.time_matmul(dtype, stream, n_rows, n_cols, x, args.threads, 1)
    calls = int(min(2000, max(copies, 0.02 / max(est, 1e-7))))
    ours = min(kernels.time_matmul(dtype, stream, n_rows, n_cols, x, args.threads, calls) for _ in range(args.trials))
    theirs = None
    if ggml is not None:
        parts = [stream[i * packed.nbytes : (i + 1) * packed.nbytes] for i in range(copies)]
        theirs = min(ggml.time_matmul(dtype, parts, n_rows, n_cols, x, args.threads, calls) for _ in range(args.trials))
    return packed.nbytes, flops, ours, theirs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--all-types", action="store_true", help="every shape for every type (default: Q4_1 shapes, "
                    "other types on 1536x576 only)")
    ap.add_argument("--no-ggml", action="store_true", help="skip the ggml comparison")
    args = ap.parse_args()
    ggml = None
    if not args.no_ggml:
        try:
            ggml = Ggml()
        except (ImportError, OSError, AttributeError) as e:
            print(f"ggml not available ({e}); pyspec only")
    configs = [("Q4_1", n, k) for n, k in SHAPES]
    for t in ("Q4_0", "Q8_0", "F16", "BF16", "F32"):
        configs += [(t, n, k) for n, k in (SHAPES if args.all_types else [(1536, 576)])]
    configs.append(LM_HEAD)
    print(f"pyspec kernels: {kernels.isa()}, {args.threads} threads, best of {args.trials}")
    print(f"{'type':5} {'N x K':>11} {'M':>4} | {'pyspec us':>10} {'GB/s':>6} {'GFLOP/s':>8} | "
          f"{'ggml us':>10} {'GB/s':>6} {'GFLOP/s':>8} | {'speedup':>7}")
    for dtype, n, k in configs:
        for m in (1, 16, 512):
            if (dtype, n, k) == LM_HEAD and m == 512:
                continue  # prompt processing only needs the last row's logits
            nbytes, flops, ours, theirs = measure(dtype, n, k, m, args, ggml)
            line = f"{dtype:5} {n:>5}x{k:<5} {m:>4} | {ours * 1e6:10.1f} {nbytes / ours / 1e9:6.1f} {flops / ours / 1e9:8.1f} | "
            if theirs is None:
                line += f"{'-':>10} {'-':>6} {'-':>8} | {'-':>7}"
            else:
                line += f"{theirs * 1e6:10.1f} {nbytes / theirs / 1e9:6.1f} {flops / theirs / 1e9:8.1f} | {theirs / ours:6.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
