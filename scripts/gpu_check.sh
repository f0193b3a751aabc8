#!/usr/bin/env bash
# Validates capsroute on a machine with an NVIDIA GPU, then measures it. Builds the extension with
# its CUDA kernels (scripts/env.sh), then runs the stages asked for, in this order:
#   doctor      capsroute doctor --device cuda: every op, kernel path and dtype against the reference
#   tests       pytest -m cuda: the CUDA tests, the large shapes of tests/ops/test_scale.py included
#   sweep       scripts/gpu_sweep.py: every op at GPU sizes against float64, then bitwise determinism
#   sanitizers  compute-sanitizer's memcheck, racecheck, initcheck and synccheck over
#               scripts/sanitizer_workload.py (each fails if a kernel path it covers never ran)
#   bench       capsroute bench against eager and compiled PyTorch at its default shapes: the
#               agreement routings (both vote layouts), EM, the conv ops, the attention routings
#               and the model training steps, with figures
#   profile     scripts/gpu_profile.py: kernel time against wall time, launches, the top kernels
#   ncu         Nsight Compute's counters over scripts/ncu_profile.py's cases, at the clocks as found:
#               ncu.ncu-rep, its raw page (ncu-raw.csv) and a table a case (ncu.md)
#
#   bash scripts/gpu_check.sh [--out DIR] [--time-limit SECONDS] [STAGE ...]   (no STAGE: all)
#
# Logs and results go to DIR (default bench/results/<gpu>-<date>-<commit>). With --time-limit a
# stage still running at the limit is stopped and the stages after it are skipped. Exits 1 if a
# stage failed or was stopped.
set -uo pipefail  # a stage's status is its command's, not that of the tee that logs it
cd "$(dirname "$0")/.."
ALL=(doctor tests sweep sanitizers bench profile ncu)
out="" limit="" stages=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --time-limit) limit=${2:-}; shift 2
      [[ $limit =~ ^[0-9]+$ ]] || { echo "gpu_check: --time-limit must be whole seconds" >&2; exit 2; } ;;
    -h|--help) sed -n '2,20p' "$0" | cut -c3-; exit 0 ;;
    *) [[ " ${ALL[*]} " == *" $1 "* ]] \
         || { echo "gpu_check: unknown stage $1 (stages: ${ALL[*]})" >&2; exit 2; }
       stages+=("$1"); shift ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || stages=("${ALL[@]}")
nvidia-smi -L > /dev/null 2>&1 || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none)" >&2; exit 1; }
export CAPSROUTE_FORCE_CUDA=1 PYTHONUNBUFFERED=1
source scripts/env.sh || exit 1
python -c "import torch, capsroute, sys; sys.exit(not (torch.cuda.is_available() and capsroute.build_info()['cuda']))" \
  || { echo "gpu_check: torch sees no GPU, or capsroute was built without CUDA" >&2; exit 1; }
if [ -z "$out" ]; then
  gpu=$(python -c "import torch; print(torch.cuda.get_device_name().lower().replace('nvidia ', '').split()[0])")
  out=bench/results/$gpu-$(date +%F)-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
mkdir -p "$out"
deadline=$(( ${limit:-0} > 0 ? SECONDS + limit : 0 ))

# run LOG COMMAND...: the command under what is left of the time limit, its output in $out/LOG.
run() {
  local log=$1; shift
  if [ "$deadline" -gt 0 ]; then
    local left=$(( deadline - SECONDS ))
    [ "$left" -gt 0 ] || { echo "gpu_check: time limit reached, not run: $*" >&2; return 124; }
    set -- timeout -k 15 -s INT "$left" "$@"
  fi
  "$@" 2>&1 | tee -a "$out/$log"
}
bench() { run bench.log python -m capsroute.cli bench --device cuda --no-progress --out "$out" --plot "$@"; }

status=0
for stage in "${stages[@]}"; do
  echo "== $stage" >&2
  start=$SECONDS
  case $stage in
    doctor) run doctor.log python -m capsroute.doctor --device cuda --no-progress --json "$out/doctor.json" ;;
    tests) run cuda-tests.log python -m pytest tests -q -m cuda ;;
    sweep) run gpu-sweep.log python scripts/gpu_sweep.py --device cuda --out "$out" ;;
    sanitizers)
      rc=0
      for tool in memcheck racecheck initcheck synccheck; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "sanitizer-$tool.log" compute-sanitizer --tool "$tool" \
          --error-exitcode 9 python scripts/sanitizer_workload.py || rc=1
      done
      [ "$rc" = 0 ] ;;
    bench)
      rc=0
      bench --op dynamic dense --layout contiguous einsum || rc=1
      bench --op em em-pose || rc=1
      bench --op conv-em conv-dynamic || rc=1
      bench --op self-attention inverted-attention dense-self-attention dense-inverted-attention || rc=1
      bench --op capsnet matrixcapsnet || rc=1
      [ "$rc" = 0 ] ;;
    profile) run profile.log python scripts/gpu_profile.py --device cuda --out "$out" ;;
    ncu)
      command -v ncu > /dev/null || { echo "gpu_check: ncu (Nsight Compute) is not on PATH" >&2; false; } \
        && run ncu.log ncu --clock-control none --profile-from-start off --set full --export "$out/ncu" -f \
             python scripts/ncu_profile.py run \
        && ncu --import "$out/ncu.ncu-rep" --page raw --csv > "$out/ncu-raw.csv" \
        && python scripts/ncu_profile.py summary "$out/ncu-raw.csv" --cases "$out/ncu.log" > "$out/ncu.md" ;;
  esac
  rc=$?
  echo "== $stage: $([ "$rc" = 0 ] && echo passed || echo "FAILED ($rc)") in $(( SECONDS - start )) s" >&2
  [ "$rc" = 0 ] || status=1
done
echo "results in $out" >&2
exit $status
