#!/usr/bin/env bash
# Everything that needs the H200, for one device call: `bash benchmarks/h200.sh STEP...` with steps
#   build      compile the extension (into .build/, kept while the machine stays warm)
#   tests      GPU test suite -> $OUT/gpu_tests.json (+ JUnit XML and log; the `alone` tests' apart)
#   sanitizer  the small-shape GPU tests under compute-sanitizer memcheck -> $OUT/sanitizer.log
#   racecheck  compute-sanitizer racecheck and synccheck over 78 small-shape tests -> $OUT/racecheck.log, synccheck.log
#   bench      python -m gn_patch.bench into $OUT/bench   (BENCH_ARGS adds flags, e.g. --quick; BENCH_OUT resumes)
#   peers      python -m gn_patch.bench --only peers --peers .peers into $OUT/bench (BENCH_OUT as for bench): gn_patch
#              against the peer kernels of .peers/ (a copy of ../shared/peers, carried), builds cached in .build/peers
#   ncu        Nsight Compute (clocks as they are) of gn_patch's kernels beside apex's at the UNet shapes
#              (benchmarks/tools/ncu_shapes.py --peers .peers; apex built into .build/peers, as by `peers`)
#              -> $OUT/ncu_shapes.txt: executed instructions per warp and cycles per issue, for the small forwards
#              (NCU_SHAPES="N,C,H,W ..." profiles those shapes instead)
#   stalls     Nsight Compute's stall reasons per issued instruction of the same kernels at NCU_SHAPES (default:
#              ncu_shapes.py's), apex's beside them -> $OUT/ncu_stalls.txt (raw) and $OUT/ncu_stalls.md
#              (benchmarks/tools/ncu_stalls.py's table: instructions per warp, cycles per issue by reason)
#   modes      benchmarks/tools/channels_last_modes.py: SD1.5's UNet patched with channels_last weights against
#              channels_last="activations" (FSDP2's mode) -> $OUT/channels_last_modes.json
#   conv3d     benchmarks/tools/conv3d_layout.py: Conv3d NCDHW vs NDHWC for the video VAE decodes, and the decodes
#              patched with channels_last_3d off and on -> $OUT/conv3d_layout.json
#   txt2img    examples/txt2img.py, SD1.5 at 512² and SDXL at 1024², fp16, --check-fp32 --cuda-graph --compile-anchor
#              -> $OUT/txt2img.json (TXT2IMG_ARCHS="sdxl" runs one: SDXL's compilation alone takes minutes)
#   training   examples/compare_training.py, SD1.5 at 512², batch 8, bf16, 50 steps -> $OUT/training.json
#   training2  the same under accelerate launch --multi_gpu on 2 GPUs (kind nvidia-h200-x2) -> $OUT/training_x2.json,
#              with the scaling against the one-GPU run when a `training` step ran before it
# The H200 machine has no diffusers and no network: carry its wheel in .whl/ (installed into /tmp/site here).
# Set GN_PATCH_COMMIT to the commit under test (the machine's copy of the tree has no .git).
set -uo pipefail
OUT=${OUT:-$PWD/.scratch/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
export GN_PATCH_BUILD_DIR=$PWD/.build
# A build killed mid-way (a `timeout` around an earlier call's step, on a machine still warm) leaves
# torch.utils.cpp_extension's `lock` file in its build folder, and every later load there waits on it for ever
# (torch 2.13 and older, as the device's 2.11: pytorch/pytorch#189245; in session 29 the apex build of one call's
# peers step was killed so, and the next call's peers and ncu steps hung).
# The steps of this script run one at a time and nothing else builds on this machine, so any lock found now is stale.
find "$GN_PATCH_BUILD_DIR" -name lock -type f -delete 2>/dev/null
# Nsight Compute over benchmarks/tools/ncu_shapes.py (apex's kernels beside gn_patch's, NCU_SHAPES narrowing the
# shapes), clocks and caches as they are: `ncu_over_shapes OUT_FILE NCU_ARGS...`.
ncu_over_shapes() {
  local out=$1
  shift
  ncu --clock-control none --cache-control none -k regex:"forward_kernel|backward_kernel|group_norm_nhwc" "$@" \
    python3 benchmarks/tools/ncu_shapes.py --peers "$PWD/.peers" ${NCU_SHAPES:+--shapes "$NCU_SHAPES"} > "$out" 2>&1
}
status=0
for step in "$@"; do
  start=$(date +%s)
  case $step in
    build) python3 -m gn_patch.build 2>&1 | tail -5 || status=1 ;;
    tests)
      # Four workers share the GPU (most tests are short and host-bound); TEST_TIMEOUT bounds the step with an
      # interrupt, after which pytest still writes the JUnit XML of the tests that ran. The `alone` tests (captures
      # through the autograd engine) run after, in one process: beside other workers' large tests an allocation
      # inside their capture can fail, and the caching allocator's retry (freeing its cache) breaks the capture.
      timeout -s INT -k 30 "${TEST_TIMEOUT:-480}" python3 -m pytest tests -m "gpu and not alone" -q \
        -n "${TEST_WORKERS:-4}" --maxfail=50 --durations=20 -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
        > "$OUT/gpu_tests.log" 2>&1
      tail -15 "$OUT/gpu_tests.log"
      timeout -s INT -k 30 "${ALONE_TIMEOUT:-120}" python3 -m pytest tests -m "gpu and alone" -q -p no:cacheprovider \
        --junitxml="$OUT/gpu_tests_alone.xml" > "$OUT/gpu_tests_alone.log" 2>&1
      tail -3 "$OUT/gpu_tests_alone.log"
      python3 benchmarks/gpu_tests_summary.py "$OUT/gpu_tests.xml" "$OUT/gpu_tests_alone.xml" "$OUT/gpu_tests.json" \
        || status=1 ;;
    sanitizer)
      # The small shapes of every geometry (one block, clusters, many groups per tile, scalar accesses, ranks 2-5,
      # straddling vectors), with and without the input terms (offset and bias together, unaligned, under autograd),
      # the frames_last rows of 5-D ones, the forward's second pass (groups whose first element lies far from their
      # mean), and the residual sum's kernel (bias_residual_add) at every vector width.
      timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --print-limit 20 \
        python3 -m pytest tests/test_ops_cuda.py -q -p no:cacheprovider -k "((test_forward_shapes or \
        test_backward_shapes or test_unaligned_pointer or test_per_sample_scale_shift or \
        test_straddling_vectors_keep_groups_apart or (test_input_offset and (both or unaligned or gradients)) \
        or test_frames_last_writes or test_group_first_elements_far_from_their_means) \
        and (sd_resnet- or sd_mid or group_size or single_group- or hw_1 or rank or rows_not_multiple \
        or odd_channels or straddling_10 or one_frame or one_position)) \
        or test_bias_residual_add_is_pytorchs_two_adds or test_bias_residual_add_other_layouts" \
        > "$OUT/sanitizer.log" 2>&1
      tail -6 "$OUT/sanitizer.log" ;;
    racecheck)
      # Shared-memory hazards (racecheck) and barrier misuse (synccheck) in the forward's and backward's block and
      # cluster reductions and the forward's second pass, at shapes of one block per group, clusters, a single
      # group and straddling vectors (racecheck runs ~100x slower than the kernels: a narrower set than memcheck's).
      racecheck_tests="(test_forward_shapes or test_backward_shapes or test_group_first_elements_far_from_their_means) \
        and (sd_mid or sd_resnet- or single_group- or straddling_10)"
      for tool in racecheck synccheck; do
        timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest \
          tests/test_ops_cuda.py -q -p no:cacheprovider -k "$racecheck_tests" > "$OUT/$tool.log" 2>&1
        tail -3 "$OUT/$tool.log"
      done ;;
    bench)
      # BENCH_OUT: a folder of the tree (carried to the machine) holding an earlier call's results, which the
      # sections and --e2e-groups of this call add to; the whole folder comes back in $OUT/bench.
      bench_out=${BENCH_OUT:-$OUT/bench}
      python3 -m gn_patch.bench --out "$bench_out" ${BENCH_ARGS:-} 2>&1 | tail -40
      [ "$bench_out" = "$OUT/bench" ] || cp -r "$bench_out" "$OUT/bench" ;;
    peers)
      bench_out=${BENCH_OUT:-$OUT/bench}
      python3 -m gn_patch.bench --only peers --peers "$PWD/.peers" --out "$bench_out" 2>&1 | tail -100
      [ "$bench_out" = "$OUT/bench" ] || cp -r "$bench_out" "$OUT/bench" ;;
    ncu)
      # SourceCounters: branch efficiency and shared-memory bank conflicts (excessive wavefronts).
      ncu_over_shapes "$OUT/ncu_shapes.txt" --section LaunchStats --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section SourceCounters || status=1
      tail -3 "$OUT/ncu_shapes.txt" ;;
    stalls)
      ncu_over_shapes "$OUT/ncu_stalls.txt" --page raw --metrics "regex:smsp__average_warps_issue_stalled_.*\
_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__warps_launched.sum,gpu__time_duration.sum" || status=1
      python3 benchmarks/tools/ncu_stalls.py "$OUT/ncu_stalls.txt" > "$OUT/ncu_stalls.md" || status=1
      cat "$OUT/ncu_stalls.md" ;;
    modes) python3 benchmarks/tools/channels_last_modes.py --json "$OUT/channels_last_modes.json" 2>&1 | tail -20 ;;
    conv3d) python3 benchmarks/tools/conv3d_layout.py --json "$OUT/conv3d_layout.json" 2>&1 | tail -60 || status=1 ;;
    txt2img)
      rm -f "$OUT/txt2img.json"
      for arch in ${TXT2IMG_ARCHS:-sd15 sdxl}; do
        size=512; [ "$arch" = sdxl ] && size=1024
        python3 examples/txt2img.py --arch "$arch" --height $size --width $size --dtype float16 --check-fp32 \
          --cuda-graph --compile-anchor --json "$OUT/txt2img.json" --output-dir /tmp/gn_patch_images 2>&1 | tail -40
      done ;;
    training)
      python3 examples/compare_training.py --output "$OUT/training.json" --work-dir /tmp/gn_patch_training \
        --commit "${GN_PATCH_COMMIT:-unknown}" ${TRAIN_ARGS:-} 2>&1 | tail -30 ;;
    training2)
      # NVLink multicast stays off on shared hosts (the device README): NCCL_NVLS_ENABLE=0 is set for the run.
      # After a `training` step in the same call, its one-GPU result gives the scaling.
      one_gpu=(); [ -f "$OUT/training.json" ] && one_gpu=(--one-gpu-json "$OUT/training.json")
      NCCL_NVLS_ENABLE=0 python3 examples/compare_training.py --num-processes 2 --output "$OUT/training_x2.json" \
        "${one_gpu[@]}" --work-dir /tmp/gn_patch_training_x2 --commit "${GN_PATCH_COMMIT:-unknown}" ${TRAIN_ARGS:-} \
        2>&1 | tail -30 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
exit $status
