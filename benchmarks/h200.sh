#!/usr/bin/env bash
# Everything that needs the H200, for one device call: `bash benchmarks/h200.sh STEP...` with steps
#   build      compile the extension (into .build/, kept while the machine stays warm)
#   tests      GPU test suite -> $OUT/gpu_tests.json (+ JUnit XML and log)
#   sanitizer  the small-shape GPU tests under compute-sanitizer memcheck -> $OUT/sanitizer.log
#   bench      python -m gn_patch.bench into $OUT/bench   (BENCH_ARGS adds flags, e.g. --quick; BENCH_OUT resumes)
#   txt2img    examples/txt2img.py, SD1.5 at 512² and SDXL at 1024², fp16, --check-fp32 -> $OUT/txt2img.json
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
status=0
for step in "$@"; do
  start=$(date +%s)
  case $step in
    build) python3 -m gn_patch.build 2>&1 | tail -5 || status=1 ;;
    tests)
      python3 -m pytest tests -m gpu -q --maxfail=20 --durations=20 -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
        > "$OUT/gpu_tests.log" 2>&1
      tail -15 "$OUT/gpu_tests.log"
      python3 benchmarks/gpu_tests_summary.py "$OUT/gpu_tests.xml" "$OUT/gpu_tests.json" || status=1 ;;
    sanitizer)
      compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest tests/test_ops_cuda.py -q -p no:cacheprovider \
        -k "(test_forward_shapes or test_backward_shapes or test_unaligned_pointer) and not wide and not many_channels" \
        > "$OUT/sanitizer.log" 2>&1
      tail -6 "$OUT/sanitizer.log" ;;
    bench)
      # BENCH_OUT: a folder of the tree (carried to the machine) holding an earlier call's results, which the
      # sections and --e2e-groups of this call add to; the whole folder comes back in $OUT/bench.
      bench_out=${BENCH_OUT:-$OUT/bench}
      python3 -m gn_patch.bench --out "$bench_out" ${BENCH_ARGS:-} 2>&1 | tail -40
      [ "$bench_out" = "$OUT/bench" ] || cp -r "$bench_out" "$OUT/bench" ;;
    txt2img)
      rm -f "$OUT/txt2img.json"
      python3 examples/txt2img.py --arch sd15 --height 512 --width 512 --dtype float16 --check-fp32 \
        --json "$OUT/txt2img.json" --output-dir /tmp/gn_patch_images 2>&1 | tail -30
      python3 examples/txt2img.py --arch sdxl --height 1024 --width 1024 --dtype float16 --check-fp32 \
        --json "$OUT/txt2img.json" --output-dir /tmp/gn_patch_images 2>&1 | tail -30 ;;
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
