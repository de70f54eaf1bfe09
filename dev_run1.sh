#!/usr/bin/env bash
# temporary (session 22): final figures of main
set -u
MODES=" " SKIP_BENCH=1 OUT=$OUT bash tools/device/cuda_check.sh 2>&1 | tail -2
timeout 420 python3 bench/bench_cuda.py --make /tmp/pyspec-models --repeats 3 --json $OUT/bench.json 2>&1 | tail -12
