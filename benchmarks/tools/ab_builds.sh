#!/usr/bin/env bash
# The kernels of another commit against the working tree's, built side by side and timed in one device call
# (benchmarks/tools/harness_times.py, CUDA-graph replay): the steps of the call that wrote
# results/h200/ab_barriers.json.
#   bash benchmarks/tools/ab_builds.sh prepare REV    here: REV's csrc/, gn_patch/ and harness into .scratch/base
#   bash benchmarks/tools/ab_builds.sh run            on the GPU machine (carry .scratch/base): both builds, then one
#                                                     harness run each -> $OUT/ab.json; set OUT, GN_PATCH_COMMIT and
#                                                     BASE_COMMIT (the machine's copy of the tree has no .git);
#                                                     AB_SUITE=1 also runs the GPU suite on the working tree's build
#                                                     (benchmarks/h200.sh tests, carry .whl) between the builds and
#                                                     the timings; HARNESS_SHAPES="N,C,H,W ..." narrows the timings
#                                                     where the base tree's harness reads it (trees from session 32 on)
# AB_STEPS picks the steps, in this order: "build suite time" is AB_SUITE=1's. On a fresh 16-core machine the builds
# and the suite took 600 s in session 38 (under 470 s in sessions 32-33), the call's limit: run AB_STEPS="build suite"
# in one call and AB_STEPS=time in the next, on the machine still warm. The base build lives in .build/base, not in
# .scratch/base, because a call's carry replaces the carried folder on the machine, and with it a build inside it.
set -euo pipefail
case ${1:-} in
  prepare)
    rm -rf .scratch/base && mkdir -p .scratch/base
    git archive "$2" csrc gn_patch benchmarks/tools/harness_times.py | tar -x -C .scratch/base ;;
  run)
    : "${OUT:?}" "${GN_PATCH_COMMIT:?}" "${BASE_COMMIT:?}"  # ab_merge.py's fields: fail before the device time goes
    # The arch benchmarks/h200.sh builds for: the machine presets TORCH_CUDA_ARCH_LIST=9.0a, a build folder (sm90a)
    # the suite's h200.sh (9.0, sm90) does not look in, so its workers built the extension again and waited on it
    # (91-133 s of each AB_SUITE call in sessions 32-33).
    export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-8} HARNESS_TORCH=0
    ROOT=$PWD BASE=$PWD/.scratch/base
    find "$ROOT/.build" -name lock -type f -delete 2>/dev/null || true  # a killed build's stale lock (h200.sh says why)
    steps=${AB_STEPS:-build $([ "${AB_SUITE:-0}" = 1 ] && echo suite) time}
    for step in $steps; do
      case $step in
        build)
          (cd "$BASE" && PYTHONPATH=$BASE GN_PATCH_BUILD_DIR=$ROOT/.build/base python3 -m gn_patch.build) \
            > /tmp/build_base.log 2>&1 &
          PYTHONPATH=$ROOT GN_PATCH_BUILD_DIR=$ROOT/.build python3 -m gn_patch.build > /tmp/build_new.log 2>&1 &
          wait
          tail -n 1 /tmp/build_base.log /tmp/build_new.log ;;
        suite)
          TEST_WORKERS=${TEST_WORKERS:-8} TEST_TIMEOUT=${TEST_TIMEOUT:-230} bash benchmarks/h200.sh tests \
            || echo "the suite failed: $OUT/gpu_tests.log" ;;
        time)
          # The base tree's harness for both builds: the same shapes and timing whatever the working tree's says.
          (cd "$BASE" && PYTHONPATH=$BASE GN_PATCH_BUILD_DIR=$ROOT/.build/base \
            python3 benchmarks/tools/harness_times.py /tmp/base.json float16 bfloat16 > /tmp/base.log)
          PYTHONPATH=$ROOT GN_PATCH_BUILD_DIR=$ROOT/.build \
            python3 "$BASE/benchmarks/tools/harness_times.py" /tmp/new.json float16 bfloat16 > /tmp/new.log
          PYTHONPATH=$ROOT python3 benchmarks/tools/ab_merge.py /tmp/base.json /tmp/new.json "$OUT/ab.json" ;;
        *) echo "unknown AB_STEPS step: $step" >&2; exit 2 ;;
      esac
    done ;;
  *) echo "usage: $0 prepare REV | run" >&2; exit 2 ;;
esac
