#!/usr/bin/env bash
# On a GPU machine (the workplace's device tool), from the repo root: train SmolLM2's DSpark
# drafter on carried data shards, resuming when a run is already there, and copy what comes back
# (hf/ checkpoint shards, validation log) to $OUT. The target GGUF (98 MB) is more than one call
# may carry next to the tracked tree (19 MiB with the shipped drafter; 64 MiB per call), so it
# travels in three parts (build/dev_p1/p1, build/dev_p2/p2, build/dev_p3/p3, 40 + 40 + 18 MB
# made with head/tail -c), one or two per call: the first call that has all three joins them
# into /tmp/smol.gguf, and later calls of the same held machine reuse it. Convert the returned hf/ here with
# pyspec-convert --target-model-dir (the GGUF exceeds what one returned file may be).
#
#   DATA="build-carry/gen-gpu-s202/data build-carry/gen-gpu-s303/data" TIME=500 \
#     bash tools/device/train_smollm2.sh [extra pyspec-train-drafter flags]
#
# Without DATA the run generates its own sequences first (--data-prompts, --seed, ...; they stay
# in $RUN/data on the held machine for the calls after). To continue from the embedded drafter,
# whose checkpoint is not carried: --init-from pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf
# (it travels with the tree).
set -u
out=${OUT:-device-out}
run=${RUN:-/tmp/run}
mkdir -p "$out" "$run"
export PYTHONUNBUFFERED=1
ls build/wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps build/wheels/*.whl
if [ ! -s /tmp/smol.gguf ]; then
  if [ -f build/dev_p1/p1 ] && [ -f build/dev_p2/p2 ] && [ -f build/dev_p3/p3 ]; then
    cat build/dev_p1/p1 build/dev_p2/p2 build/dev_p3/p3 > /tmp/smol.gguf
  else
    echo "no /tmp/smol.gguf and not all three parts here (build/dev_p{1,2,3}/p{1,2,3})"
    exit 2
  fi
fi
python3 -c "import pyspec" 2>/dev/null || {
  cmake -S . -B build/cpu -G Ninja -DPYSPEC_INPLACE=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null &&
    cmake --build build/cpu -j"$(nproc)" --target _core > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
}
resume=()
[ -f "$run/train_state.pt" ] && resume=(--resume)
# shellcheck disable=SC2086
python3 -m pyspec.train.cli --target /tmp/smol.gguf --out "$run" ${DATA:+--data $DATA} \
  --device cuda --time-limit "${TIME:-500}" --hf-dtype bf16 --max-shard-mib 15 --no-progress \
  ${resume[@]+"${resume[@]}"} "$@" 2>&1 | grep -v -i warning | tee "$out/train.log" | tail -25
[ -d "$run/hf" ] && cp -r "$run/hf" "$out/hf"
[ -f "$run/eval_log.jsonl" ] && cp "$run/eval_log.jsonl" "$out/"
ls -la "$out" "$out/hf" 2>/dev/null
