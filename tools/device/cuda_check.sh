#!/usr/bin/env bash
# On a GPU machine (the workplace's device tool), from the repo root: build the CUDA core in
# place, run the CUDA test files four ways (as is: prompt rows on tensor cores, output rows on CUDA
# cores; without fusions, PYSPEC_CUDA_FUSE=0; every row on tensor cores, PYSPEC_CUDA_TC=1; without
# the row-tiled attention, PYSPEC_CUDA_ATT_TILED=0; MODES may add cores, every row on CUDA cores:
# PYSPEC_CUDA_TC=0, nopdl, plain launches: PYSPEC_CUDA_PDL=0, noatttc, prompt rows' attention
# on CUDA cores: PYSPEC_CUDA_ATT_TC=0, and nowgmma, the wide tensor-core MUL_MAT on mma.sync:
# PYSPEC_CUDA_WGMMA=0, and notma, the wgmma MUL_MAT fed by cp.async: PYSPEC_CUDA_WGMMA_TMA=0,
# and wgmma, every row on tensor cores and every wide call on wgmma however
# small: PYSPEC_CUDA_TC=1 PYSPEC_CUDA_WGMMA_CFG=L, and noprefetch, no L2 prefetch before the PDL
# wait: PYSPEC_CUDA_PREFETCH=0, and noearly, the decode attention without its early reads:
# PYSPEC_CUDA_ATT_EARLY=0, and nocopy, its first cache cells copied and the next kernel let in after
# its PDL wait: PYSPEC_CUDA_ATT_EARLY_COPY=0 PYSPEC_CUDA_ATT_LET_IN_FIRST=0, and rowtma, one-column
# MUL_MATs on the copy-engine row groups (opt-in):
# PYSPEC_CUDA_ROW_TMA=1, and noevict, the row streams' weight loads without the L2 evict-first
# hint: PYSPEC_CUDA_L2_EVICT_FIRST=0, and latenorm, the row streams' norm prologue reading the
# norm's weights after the PDL wait, not copied before it: PYSPEC_CUDA_NORM_EARLY=0, and
# nodeep, row launches of one item a warp on the balanced grid, not the deep one:
# PYSPEC_CUDA_ROW_DEEP=0, and nopiped, the other row launches not fed piped:
# PYSPEC_CUDA_ROW_PIPED=0, and twoblocks, the piped launches on two blocks of 8 warps a SM:
# PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK=0, and noroom, a decode step's q/k/v launch on every SM, none
# left free for the attention after it: PYSPEC_CUDA_ROW_ROOM=0; BENCH_MODES may add noatttc, nowgmma, notma and noprefetch too),
# then bench/bench_cuda.py with its profile. Prints a
# summary line per step; full logs and bench JSON go to $OUT (default ./device-out).
#
#   bash tools/device/cuda_check.sh            # about 5 minutes on an H200, bench included
#   SKIP_BENCH=1 bash tools/device/cuda_check.sh
#   MODES= SKIP_BENCH=1 SANITIZE=1 bash tools/device/cuda_check.sh   # the sanitizer alone (no test modes)
#   MODES="plain nofuse" BENCH_MODES=plain bash tools/device/cuda_check.sh   # fewer runs
#   KERNEL_TIMES=1 ...                          # also per-kernel times by ncu (tools/device/kernel_times.py)
#   KERNEL_DETAIL=k_mul_mat_tc_narrow_f ...     # also ncu's full report (stall reasons, memory, occupancy)
#                                               # of that kernel in a Qwen3-4B decode step, every row on
#                                               # tensor cores (KD_MODEL, KD_STEP, KD_ENV change that;
#                                               # the bench step makes the models: not with SKIP_BENCH)
#   SANITIZE=1 ...                              # also compute-sanitizer memcheck and racecheck on a
#                                               # decode + speculative step (tiny models), on the
#                                               # attention kernels, a split long row included (and
#                                               # with the decode row's RoPE in the launch), on
#                                               # the wide GEMM's split K, the norm prologue and
#                                               # the split ARGMAX / TOP_K
#   SPEC_BENCH=/tmp/smol.gguf ...               # also bench/bench_drafter.py on the GPU: the real
#                                               # SmolLM2 target (carried, see train_smollm2.sh)
#                                               # with the shipped drafter (DRAFTER=path when it
#                                               # was moved out of the tree), greedy
set -u
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ls build/wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps build/wheels/*.whl
cmake -S . -B build/cuda -G Ninja -DPYSPEC_CUDA=ON -DPYSPEC_INPLACE=ON \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$out/build.log" 2>&1 &&
  cmake --build build/cuda -j"$(nproc)" --target _core >> "$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

tests="tests/test_cuda_ops.py tests/test_cuda_matmul.py tests/test_cuda_attention.py tests/test_cuda_models.py tests/test_cuda_graphs.py"
for mode in ${MODES-plain nofuse tc notiled}; do
  case $mode in
    plain) envs=() ;;
    nofuse) envs=(PYSPEC_CUDA_FUSE=0) ;;
    notiled) envs=(PYSPEC_CUDA_ATT_TILED=0) ;;
    tc) envs=(PYSPEC_CUDA_TC=1) ;;
    cores) envs=(PYSPEC_CUDA_TC=0) ;;
    nopdl) envs=(PYSPEC_CUDA_PDL=0) ;;
    noatttc) envs=(PYSPEC_CUDA_ATT_TC=0) ;;
    nowgmma) envs=(PYSPEC_CUDA_WGMMA=0) ;;
    notma) envs=(PYSPEC_CUDA_WGMMA_TMA=0) ;;
    wgmma) envs=(PYSPEC_CUDA_TC=1 PYSPEC_CUDA_WGMMA_CFG=L) ;;
    noprefetch) envs=(PYSPEC_CUDA_PREFETCH=0) ;;
    nosplit) envs=(PYSPEC_CUDA_COLUMN_SPLIT=0) ;;
    noearly) envs=(PYSPEC_CUDA_ATT_EARLY=0) ;;
    nocopy) envs=(PYSPEC_CUDA_ATT_EARLY_COPY=0 PYSPEC_CUDA_ATT_LET_IN_FIRST=0) ;;
    rowtma) envs=(PYSPEC_CUDA_ROW_TMA=1) ;;
    noevict) envs=(PYSPEC_CUDA_L2_EVICT_FIRST=0) ;;
    latenorm) envs=(PYSPEC_CUDA_NORM_EARLY=0) ;;
    nodeep) envs=(PYSPEC_CUDA_ROW_DEEP=0) ;;
    nopiped) envs=(PYSPEC_CUDA_ROW_PIPED=0) ;;
    twoblocks) envs=(PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK=0) ;;
    noroom) envs=(PYSPEC_CUDA_ROW_ROOM=0) ;;
  esac
  # shellcheck disable=SC2086
  timeout 300 env ${envs[@]+"${envs[@]}"} python3 -m pytest -q -p no:cacheprovider $tests > "$out/tests-$mode.log" 2>&1
  echo "tests ($mode): $(tail -1 "$out/tests-$mode.log")"
done

if [ -z "${SKIP_BENCH:-}" ]; then
  for mode in ${BENCH_MODES:-plain tc}; do
    envs=()
    only=${ONLY:-tg128,tgdepth,pp512,par64}
    prof=--profile
    [ $mode = tc ] && envs=(PYSPEC_CUDA_TC=1)
    [ $mode = cores ] && envs=(PYSPEC_CUDA_TC=0)
    # plain launches, without programmatic dependent launch (cuda/launch.cuh)
    [ $mode = nopdl ] && envs=(PYSPEC_CUDA_PDL=0)
    # prompt rows' attention on the CUDA cores (cuda/ops_attention_tc.cu off), for pp512's A/B
    [ $mode = noatttc ] && envs=(PYSPEC_CUDA_ATT_TC=0) && only=pp512
    # the wide tensor-core MUL_MAT on mma.sync instead of wgmma (cuda/matmul_tc_wgmma.cu), for A/B
    [ $mode = nowgmma ] && envs=(PYSPEC_CUDA_WGMMA=0) && only=pp512,par64
    # the wgmma MUL_MAT fed by cp.async instead of TMA (cuda/matmul_tc_tma.cu), for A/B
    [ $mode = notma ] && envs=(PYSPEC_CUDA_WGMMA_TMA=0) && only=pp512,par64
    # no L2 prefetch before the PDL wait (weights of the decode MUL_MATs, attention's first chunk)
    [ $mode = noprefetch ] && envs=(PYSPEC_CUDA_PREFETCH=0) && only=${ONLY:-tg128,tgdepth}
    # m's columns per warp for short rows too (cuda/ops_matmul.cu small_tile), for A/B
    [ $mode = nosplit ] && envs=(PYSPEC_CUDA_COLUMN_SPLIT=0) && only=${ONLY:-tg128}
    # without the row-tiled attention for batches (pp, par64; the same bits as the per-row kernel)
    [ $mode = notiled ] && envs=(PYSPEC_CUDA_ATT_TILED=0) && only=pp512,par64 && prof=
    timeout 240 env ${envs[@]+"${envs[@]}"} python3 bench/bench_cuda.py --make /tmp/pyspec-models --repeats ${REPEATS:-2} --only $only \
      $prof --json "$out/bench-$mode.json" > "$out/bench-$mode.log" 2>&1
    echo "bench ($mode):"
    sed -n '/^pyspec (CUDA) vs/,$p' "$out/bench-$mode.log"
  done
  grep -A14 "profile, decode step" "$out/bench-plain.log" | head -32
fi
if [ -n "${SPEC_BENCH:-}" ]; then
  timeout 300 python3 bench/bench_drafter.py --model "$SPEC_BENCH" -ngl all \
    --drafter "${DRAFTER:-pyspec/data/SmolLM2-135M-Instruct-DSpark.Q4_1.gguf}" --draft-n-max "${SPEC_N_MAX:-2,3,4}" \
    --modes greedy --repeats 2 --json "$out/bench-drafter-gpu.json" > "$out/bench-drafter-gpu.log" 2>&1
  echo "speculative decoding on the GPU:"
  cat "$out/bench-drafter-gpu.log" | tail -14
fi
if [ -n "${SANITIZE:-}" ]; then
  # Graph replay off: the sanitizer checks the launches themselves.
  san_tests=(tests/test_cuda_models.py::test_spec_engine_greedy_equals_plain_greedy
             "tests/test_cuda_models.py::test_logits_match_the_cpu"
             "tests/test_cuda_attention.py::test_staged_attention_gives_the_unstaged_kernels_bits[0-h9kv3d64]"
             "tests/test_cuda_attention.py::test_staged_attention_gives_the_unstaged_kernels_bits[0-h32kv8d128]"
             "tests/test_cuda_attention.py::test_prompt_rows_attention_is_each_rows_own[h9kv3d64]"
             "tests/test_cuda_attention.py::test_prompt_rows_attention_is_each_rows_own[h4kv2d64]"
             "tests/test_cuda_matmul.py::test_mul_mat[tensor_cores-F16-64-n257k2048]"
             "tests/test_cuda_matmul.py::test_wgmma_gemm_gives_the_mma_sync_bits[F16-576-L-tma]"
             "tests/test_cuda_matmul.py::test_wgmma_gemm_gives_the_mma_sync_bits[F16-200-S-tma]"
             "tests/test_cuda_matmul.py::test_wgmma_gemm_gives_the_mma_sync_bits[Q4_1-2560-S-tma]"
             "tests/test_cuda_matmul.py::test_wgmma_gemm_gives_the_mma_sync_bits[BF16-2560-M-tma]"
             "tests/test_cuda_matmul.py::test_wgmma_gemm_gives_the_mma_sync_bits[F16-576-L-cp.async]"
             "tests/test_cuda_models.py::test_prompt_rows_with_logits_keep_their_bits_in_any_batch[qwen3]"
             "tests/test_cuda_matmul.py::test_norm_prologue_gives_the_unfused_bits[F16-group-norm_early]"
             "tests/test_cuda_matmul.py::test_norm_prologue_gives_the_unfused_bits[BF16-glu-norm_early]"
             "tests/test_cuda_matmul.py::test_norm_prologue_gives_the_unfused_bits[Q4_1-glu-]"
             "tests/test_cuda_matmul.py::test_row_streams_on_the_deep_grid_give_the_same_bits[F16]"
             "tests/test_cuda_matmul.py::test_row_streams_fed_piped_give_the_same_bits[BF16-one_block]"
             "tests/test_cuda_models.py::test_decode_qkv_leaves_room_for_the_attention[qwen3]"
             "tests/test_cuda_attention.py::test_decode_rope_store_attention_as_one_launch[-short-h9kv3d64]"
             "tests/test_cuda_attention.py::test_decode_rope_store_attention_as_one_launch[-long-h32kv8d128]"
             "tests/test_cuda_attention.py::test_decode_rope_store_attention_as_one_launch[-cache_written-h32kv8d128]"
             "tests/test_cuda_attention.py::test_decode_rope_store_attention_as_one_launch[noearly-neox_half-h6kv3d40]"
             "tests/test_cuda_attention.py::test_decode_attentions_of_a_step_share_its_angles[h32kv8d128]"
             "tests/test_cuda_attention.py::test_decode_rope_store_attention_as_one_launch[-qk_norm-h32kv8d128]"
             "tests/test_cuda_ops.py::test_argmax_first_index_on_ties[151936-1]"
             "tests/test_cuda_matmul.py::test_row_groups_through_the_copy_engine_give_the_row_streams_bits[F16-group-16]"
             "tests/test_cuda_matmul.py::test_row_groups_through_the_copy_engine_give_the_row_streams_bits[BF16-glu-8-start]"
             "tests/test_cuda_ops.py::test_top_k_then_gather_equal_the_cpu[151936-64-1]")
  for tool in memcheck racecheck; do
    timeout 600 env PYSPEC_CUDA_GRAPHS=0 compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider "${san_tests[@]}" > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc $? ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize-$tool.log" | tail -1)) $(tail -1 "$out/sanitize-$tool.log")"
  done
fi
if [ -n "${KERNEL_TIMES:-}" ]; then
  for m in /tmp/pyspec-models/smollm2-135m-q4_1.gguf /tmp/pyspec-models/qwen3-4b-f16.gguf; do
    for step in ${KT_STEPS:-decode par64 pp512}; do
      timeout 120 python3 tools/device/kernel_times.py "$m" --step $step --top 12 2>&1 | tee -a "$out/kernel-times.log"
    done
  done
fi
if [ -n "${KERNEL_DETAIL:-}" ]; then
  # shellcheck disable=SC2086
  timeout 300 env ${KD_ENV:-PYSPEC_CUDA_TC=1} python3 tools/device/kernel_times.py \
    "${KD_MODEL:-/tmp/pyspec-models/qwen3-4b-f16.gguf}" --step "${KD_STEP:-decode}" --detail "$KERNEL_DETAIL" \
    > "$out/kernel-detail.log" 2>&1
  echo "kernel detail ($KERNEL_DETAIL): rc $?, $(wc -l < "$out/kernel-detail.log") lines in kernel-detail.log"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots" \
    "$out/kernel-detail.log" | head -30
fi
