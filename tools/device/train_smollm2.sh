#!/usr/bin/env bash
# On a GPU machine (the workplace's device tool), from the repo root: train SmolLM2's DSpark
# drafter on carried data shards, resuming when a run is already there, and copy what comes back
# (hf/ checkpoint shards, validation log) to $OUT. The target GGUF (98 MB) is more than one call
# may carry next to the tracked tree (64 MiB per call, tree included), so it travels in parts,
# build/dev_p1/p1, build/dev_p2/p2, ... (made with head/tail -c), with its byte count in
# build/dev_p1/size: the first call of a held machine that has every part joins them into
# /tmp/smol.gguf, and later calls reuse it. With the tree at 19 MiB that is three calls (40 + 40
# + 18 MB); with the shipped drafter moved out of the tree for those calls (2.3 MiB left) and
# carried as build/drafter/ instead, two (60 MB, then the rest beside the drafter):
#
#   T=$(python3 -c "import pyspec; print(pyspec.default_model_path())")
#   mkdir -p build/dev_p1 build/dev_p2 build/drafter; stat -c %s $T > build/dev_p1/size
#   head -c 60000000 $T > build/dev_p1/p1; tail -c +60000001 $T > build/dev_p2/p2
#   mv pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf build/drafter/   # back after the calls
#
# The calls follow each other within the machine's idle release (30 s). Convert the returned hf/
# here with pyspec-convert --target-model-dir (the GGUF exceeds what one returned file may be).
#
#   DATA="build-carry/gen-gpu-s202/data build-carry/gen-gpu-s303/data" TIME=500 \
#     bash tools/device/train_smollm2.sh [extra pyspec-train-drafter flags]
#
# Without DATA the run generates its own sequences first (--data-prompts, --seed, ...; they stay
# in $RUN/data on the held machine for the calls after). The core is built with CUDA where nvcc
# exists, so the engine can generate them on the GPU (run s8, ~2.3x the torch generator):
#
#   TIME=450 bash tools/device/train_smollm2.sh --generate-only --gen-engine 128 \
#     --gen-backend cuda --gen-sampler server --data-prompts 30000 --chat-fraction 0.7 \
#     --self-prompts 0.5 --seed 911
#
# To continue from the embedded drafter,
# whose checkpoint is not carried: --init-from pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf
# (or build/drafter/... when it was moved out of the tree).
set -u
out=${OUT:-device-out}
run=${RUN:-/tmp/run}
mkdir -p "$out" "$run"
export PYTHONUNBUFFERED=1
ls build/wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps build/wheels/*.whl
if [ ! -s /tmp/smol.gguf ]; then
  parts=$(ls -d build/dev_p*/ 2>/dev/null | sort -V | while read -r d; do n=${d%/}; n=${n##*dev_}; [ -f "$d$n" ] && echo "$d$n"; done)
  want=$(cat build/dev_p1/size 2>/dev/null || echo 0)
  # shellcheck disable=SC2086
  have=$( [ -n "$parts" ] && cat $parts | wc -c || echo 0)
  if [ "$want" -gt 0 ] && [ "$have" -eq "$want" ]; then
    # shellcheck disable=SC2086
    cat $parts > /tmp/smol.gguf
  else
    echo "no /tmp/smol.gguf, and the parts here ($(echo $parts)) hold $have of ${want} bytes (build/dev_p1/size)"
    exit 2
  fi
fi
python3 -c "import pyspec" 2>/dev/null || {
  cuda=${CUDA:-}   # CUDA=OFF: a 15 s CPU build where the run only trains (no --gen-engine)
  [ -z "$cuda" ] && { cuda=OFF; command -v nvcc >/dev/null 2>&1 && cuda=ON; }
  cmake -S . -B build/train -G Ninja -DPYSPEC_INPLACE=ON -DPYSPEC_CUDA=$cuda \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null &&
    cmake --build build/train -j"$(nproc)" --target _core > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
}
resume=()
[ -f "$run/train_state.pt" ] && resume=(--resume)
# shellcheck disable=SC2086
python3 -m pyspec.train.cli --target /tmp/smol.gguf --out "$run" ${DATA:+--data $DATA} \
  --device cuda --time-limit "${TIME:-500}" --hf-dtype bf16 --max-shard-mib 15 --no-progress \
  ${resume[@]+"${resume[@]}"} "$@" 2>&1 | grep -v -i warning | tee "$out/train.log" | tail -25
# a data-only run brings its shards back (each at most --data-shard-mib, 15 MiB by default)
case " $* " in *" --generate-only "*) cp "$run"/data/data-*.npz "$out"/ 2>/dev/null ;; esac
[ -d "$run/hf" ] && cp -r "$run/hf" "$out/hf"
[ -f "$run/eval_log.jsonl" ] && cp "$run/eval_log.jsonl" "$out/"
ls -la "$out" "$out/hf" 2>/dev/null
