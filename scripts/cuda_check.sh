#!/usr/bin/env bash
# What a machine with a GPU should run, stage by stage (default: all): the CUDA tests, then
# compute-sanitizer memcheck and racecheck over scripts/sanitizer_workload.py, then the benchmark.
# Logs and the benchmark JSON and figures go to $OUT if set (the device tool's output folder), else bench/results.
#   bash scripts/cuda_check.sh [tests] [sanitize] [bench] [bench-em] [bench-large]
source "$(dirname "$0")/env.sh"
out=${OUT:-bench/results}
mkdir -p "$out"
stages=${*:-tests sanitize bench}
status=0
for stage in $stages; do
  case $stage in
    tests)
      python -m pytest tests -q -m cuda 2>&1 | tee "$out/cuda-tests.log" || status=1 ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitizer_workload.py 2>&1 \
          | tee "$out/sanitizer-$tool.log" | tail -5 || status=1
      done ;;
    bench)
      python -m capsroute.cli bench --device cuda --op dynamic dense --shape mnist --batch 32 128 512 2048 --no-progress --plot --out "$out" || status=1 ;;
    bench-em)
      python -m capsroute.cli bench --device cuda --op em em-pose --no-progress --plot --out "$out" || status=1 ;;
    bench-large)
      python -m capsroute.cli bench --device cuda --op dynamic dense --shape large --batch 32 128 --no-progress --plot --out "$out" || status=1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
