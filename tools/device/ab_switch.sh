#!/usr/bin/env bash
# On a GPU machine (the workplace's device tool), from the repo root: an A/B of one environment
# switch, its settings alternating in one run (a shared machine drifts by +-10% between runs, so
# only alternating runs compare). Builds the CUDA core first unless pyspec/_core already has it,
# makes the bench models it needs, then per round and setting prints bench_cuda.py's tg128 line of
# each model and, with SPEC_BENCH (the real SmolLM2 target, carried as train_smollm2.sh's header
# says), bench_drafter.py's wall-clock split and speed-up on chat prompts.
#
#   VAR=PYSPEC_CUDA_PREFETCH bash tools/device/ab_switch.sh
#   VAR=PYSPEC_SAMPLED_AHEAD ONLY=tg128,par64 BENCH_ARGS="--sample --par-all" MODELS="smollm2 qwen3" \
#     bash tools/device/ab_switch.sh     # sampled requests (llama-server's chain)
#   VAR=PYSPEC_CUDA_COLUMN_SPLIT VALUES="1 0" ROUNDS=2 MODELS="smollm2 qwen3" \
#     SPEC_BENCH=/tmp/smol.gguf DRAFTER=build/drafter/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf \
#     bash tools/device/ab_switch.sh
#
#   SETTINGS="default PYSPEC_CUDA_PREFETCH=0 PYSPEC_CUDA_ROW_TMA=1" MODELS=qwen3 ROUNDS=3 \
#     bash tools/device/ab_switch.sh     # several switches alternating in the same rounds
#
#   BASE=build/ab-base SETTINGS="base default" MODELS=qwen3 bash tools/device/ab_switch.sh
#                                        # this tree against another revision's, built side by side
#
# BASE: a source tree of another revision, made here and carried (["build/ab-base", ...]):
#   rm -rf build/ab-base && mkdir -p build/ab-base && git archive REV | tar -x -C build/ab-base
# It is built in place there; the setting "base" runs that tree's bench on its own build, so a
# change without a switch (a kernel rewritten, a default changed) is measured in alternating runs.
# MODELS: smollm2 (Q4_1, 135M shapes) and/or qwen3 (F16, 4B shapes; its file takes ~30 s to make).
# SETTINGS: settings compared instead of VAR's VALUES, each NAME=VALUE assignments joined by commas
# (PYSPEC_CUDA_ROW_TMA=1,PYSPEC_CUDA_ROW_TMA_STAGES=8), or "default", the environment as is, or
# "base", BASE's build (below).
set -u
if [ -n "${SETTINGS:-}" ]; then
  settings=$SETTINGS
else
  var=${VAR:?VAR=the environment switch to compare, or SETTINGS=...}
  settings=""
  for v in ${VALUES:-1 0}; do settings="$settings $var=$v"; done
fi
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ls build/wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps build/wheels/*.whl
if ! python3 -c "from pyspec import _core; assert _core.cuda_available()[0]" 2>/dev/null; then
  MODES=" " SKIP_BENCH=1 OUT="$out" bash tools/device/cuda_check.sh || exit 1
fi
if [ -n "${BASE:-}" ]; then
  cmake -S "$BASE" -B "$BASE/build/cuda" -G Ninja -DPYSPEC_CUDA=ON -DPYSPEC_INPLACE=ON \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$out/build-base.log" 2>&1 &&
    cmake --build "$BASE/build/cuda" -j"$(nproc)" --target _core >> "$out/build-base.log" 2>&1 ||
    { tail -30 "$out/build-base.log"; exit 1; }
fi
dir=/tmp/pyspec-models
mkdir -p "$dir"
paths=()
for m in ${MODELS:-smollm2}; do
  case $m in
    smollm2) preset=smollm2-135m-q4_1 ;;
    qwen3) preset=qwen3-4b-f16 ;;
    *) echo "unknown model $m (smollm2, qwen3)"; exit 2 ;;
  esac
  [ -f "$dir/$preset.gguf" ] || python3 tools/make_random_gguf.py --preset $preset -o "$dir/$preset.gguf" -q
  paths+=("$dir/$preset.gguf")
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for setting in $settings; do
    echo "== $setting (round $r)"
    assign=()
    root=.
    if [ "$setting" = base ]; then
      root=${BASE:?the setting base needs BASE=dir}
    elif [ "$setting" != default ]; then
      IFS=, read -ra assign <<< "$setting"
    fi
    for p in "${paths[@]}"; do
      # shellcheck disable=SC2086
      env ${assign[@]+"${assign[@]}"} timeout 240 python3 "$root/bench/bench_cuda.py" "$p" --only "${ONLY:-tg128}" \
        --repeats "${REPEATS:-2}" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/ab-bench.log" | grep -E "tg128 |par64 "
    done
    if [ -n "${SPEC_BENCH:-}" ]; then
      env ${assign[@]+"${assign[@]}"} timeout 240 python3 "$root/bench/bench_drafter.py" --model "$SPEC_BENCH" -ngl all \
        --drafter "${DRAFTER:-pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf}" --draft-n-max "${SPEC_N_MAX:-2}" \
        --modes greedy --sets "${SPEC_SETS:-chat,code}" --repeats 1 2>&1 | tee -a "$out/ab-drafter.log" |
        grep -E "^wall|^greedy"
    fi
  done
done
