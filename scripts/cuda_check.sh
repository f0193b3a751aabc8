#!/usr/bin/env bash
# What a machine with a GPU should run, in calls of the device tool (at most 10 minutes each; plan
# CALL_SECONDS = 570), stage by stage, each stage under its own time limit and its results packed
# as it ends:
#   bash scripts/cuda_check.sh [STAGE... | call-N]       (nothing given: call-1)
#   DRY_RUN=1 bash scripts/cuda_check.sh [STAGE... | call-N]   the plan and its budgets, no GPU
#                                                  (nothing given: every call of the plan)
#
# The plan of a GPU session, in value order (one line a call; the budgets below; the build only in
# the first call, later calls carry build-cache and unpack it):
#   call-1  build doctor bench-minimal tests  the install works on the GPU, on every path; the
#                                             minimal timings of each path; the CUDA test suite
#   call-2  memcheck racecheck:routing,em     the sanitizers that find overruns and races
#   call-3  racecheck:conv,attention initcheck synccheck   the rest of racecheck; the other two
#   call-4  sweep profile bench               the float64 sweep at GPU sizes; where the missed
#                                             targets' time goes; the routing benchmark
#   call-5  bench-conv bench-em               the conv ops; the EM benchmark
#   call-6  bench-models tests-scale          model steps and the largest batches; I = 16384
#   call-7  graph-step train-capsnet          the step in a CUDA graph; CapsNet on MNIST, the rest
# Every call starts with setup (45 s: the carried build unpacked, the environment, the GPU check);
# the first builds instead (150 s). The budgets are two to three times what each stage took on an
# H100 (bench/results/nvidia-h100-*) where it ran there; each stage's log line says what it took.
# `DRY_RUN=1 bash scripts/cuda_check.sh` checks that each call's budgets fit CALL_SECONDS.
#
# Stages (budget in seconds; a stage may run longer where the call has time to spare, that is what
# is left of the call less the budgets of the stages after it):
#   doctor (90)           capsroute doctor --device cuda: every op, path and dtype against the
#                         reference, the path each ran, timings against eager
#   bench-minimal (120)   capsroute alone: dynamic_routing B = 32, 512 without and with clusters;
#                         dense_capsules B = 32, 512; em_routing class and conv shapes (B = 64,
#                         2304); each report has the copy bandwidth
#   bench-baselines (240) eager and torch.compile once per minimal shape
#   tests (150)           the CUDA tests (-m cuda)
#   tests-scale (150)     I = 16384 at B = 1 or 2
#   sweep (180)           scripts/gpu_sweep.py
#   memcheck (200), racecheck (300), initcheck (130), synccheck (60)   compute-sanitizer over
#                         scripts/sanitizer_workload.py; TOOL:SECTION,... over those sections of
#                         it alone (routing, em, conv, attention), for racecheck, which did not
#                         finish the whole workload in 235 s at 9465c6f; `sanitize` is all four,
#                         memcheck first, two calls' worth
#   profile (90)          scripts/gpu_profile.py: the torch profiler over the cases that missed
#                         their targets (kernel time against wall time, launches, top kernels)
#   bench (240), bench-em (240), bench-large (240), bench-scale (180), bench-models (300)
#   bench-attention (200) the attention routings on given votes and their dense forms (votes made
#                         from u and the weight), every impl, at Efficient-CapsNet's and MNIST's
#                         shapes (B = 32, 512) and I = 16384 (B = 8); not yet measured on a GPU:
#                         the budget is a guess, and no call plans it yet (run it by name)
#   bench-conv (200)      conv_em_routing (per-window row included) and conv_dynamic_routing, every
#                         impl, at MatrixCapsNet's conv layers (B = 512), image scale (B = 1) and
#                         SegCaps-like (B = 16), and there conv_dynamic_routing an image a chunk
#                         and on the warp rows; not yet measured on a GPU: the budget is a guess
#                         (conv EM's kernel, predicted at milliseconds a call, leaves it to eager
#                         and compiled; docs/kernels.md)
#   graph-step (150)      `capsroute train --cuda-graph`: its CUDA tests, then 3 CapsNet MNIST
#                         epochs with and without it (the epochs' seconds in the logs and
#                         graph-step-*-metrics.json; needs data/mnist); not yet run on a GPU: the
#                         budget is a guess
#   train-MODEL[-fashion|-multimnist] (the rest of the call)
#
# The train stages (train-MODEL for MNIST, train-MODEL-fashion for Fashion-MNIST, train-MODEL-multimnist
# for MultiMNIST pairs, PAIRS_PER_DIGIT x 60,000 an epoch, default 10) need the data in data/mnist or
# data/fashion-mnist (git-ignored: copy it there and carry "data" to the GPU machine). A run trains
# until the call's time is up, less a minute (at most TRAIN_SECONDS, if set), then stops with a
# checkpoint (SIGINT is taken between steps); the next call resumes the run in runs/. CALL_SECONDS
# (default 570) must be what the call may run: through the device tool, its timeout_s or the device
# time left, whichever is less, less 30 s.
#
# Without OUT, logs, JSON and figures go to bench/results. With OUT (the device tool's output folder,
# which brings back at most 8 files, from a machine that starts bare on every call):
# - everything the stages write is packed into $OUT/cuda-check.tar.gz as each stage ends, every 30 s
#   and at the end, so a call cut off by its time limit still brings back what its stages wrote;
# - a build made by this call is packed into $OUT/capsroute-build.tar.gz: put it in build-cache/
#   (git-ignored) and carry "build-cache", and the next call unpacks it and skips the build
#   when the sources, build settings and torch are unchanged;
# - a run whose checkpoint is under 15 MiB (MatrixCapsNet's, not CapsNet's) is packed with the rest,
#   as $OUT/run-MODEL-DATASET.tar.gz: unpack it here and carry "runs/MODEL-DATASET" to resume it.
started=$SECONDS
set -o pipefail  # a stage's status is its command's, not that of the tee that logs it
cd "$(dirname "$0")/.."
CALL_SECONDS=${CALL_SECONDS:-570}
# Each stage's time budget in seconds (the header's table). setup: a call's start with the build
# carried in build-cache (unpack, environment, the GPU check); build: the same with the build
# (about 100 s on the H100 machine's 16 cores).
declare -A budget=([setup]=45 [build]=150 [doctor]=90 [bench-minimal]=120 [bench-baselines]=240
  [tests]=150 [tests-scale]=150 [sweep]=180 [memcheck]=200 [racecheck]=300
  [initcheck]=130 [synccheck]=60 [bench]=240 [bench-em]=240 [bench-large]=240 [bench-scale]=180
  [bench-models]=300 [bench-conv]=200 [bench-attention]=200 [profile]=90 [graph-step]=150)
# The calls of a GPU session, in value order (the header's plan).
calls=("build doctor bench-minimal tests" "memcheck racecheck:routing,em"
       "racecheck:conv,attention initcheck synccheck" "sweep profile bench"
       "bench-conv bench-em" "bench-models tests-scale" "graph-step train-capsnet")
# The stages asked for, call-N and sanitize expanded; fails on an unknown one before anything runs.
stages=()
for arg in "${@:-call-1}"; do
  case $arg in
    call-*) n=${arg#call-}
            [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le ${#calls[@]} ] || { echo "unknown call $arg" >&2; exit 2; }
            read -ra more <<< "${calls[n-1]}"; stages+=("${more[@]}") ;;
    sanitize) stages+=(memcheck racecheck initcheck synccheck) ;;  # memcheck first
    train-*) stages+=("$arg") ;;  # checked when it runs
    memcheck:*|racecheck:*|initcheck:*|synccheck:*)  # sections of scripts/sanitizer_workload.py
      section='(routing|em|conv|attention)'
      [[ ${arg#*:} =~ ^$section(,$section)*$ ]] \
        || { echo "unknown stage $arg (sections: routing, em, conv, attention)" >&2; exit 2; }
      stages+=("$arg") ;;
    *) [ -n "${budget[$arg]:-}" ] && [ "$arg" != setup ] || { echo "unknown stage $arg" >&2; exit 2; }
       stages+=("$arg") ;;
  esac
done

# One call's plan: its stages and their budgets (train stages: the rest of the call, at least 2
# minutes), and whether they fit CALL_SECONDS; fails where they do not.
plan() {
  local name=$1 total=0 listing="" stage seconds; shift
  if [ "$1" != build ]; then total=${budget[setup]}; listing="setup $total"; fi
  for stage in "$@"; do
    case $stage in
      train-*) seconds=$(( CALL_SECONDS - total )); [ "$seconds" -ge 120 ] || seconds=120 ;;
      *) seconds=${budget[${stage%%:*}]} ;;
    esac
    total=$(( total + seconds )); listing+="${listing:+ + }$stage $seconds"
  done
  if [ "$total" -le "$CALL_SECONDS" ]; then echo "$name: $listing = $total s of $CALL_SECONDS: fits"
  else echo "$name: $listing = $total s of $CALL_SECONDS: does not fit"; return 1; fi
}
if [ -n "${DRY_RUN:-}" ]; then  # the plan alone: every call's, or that of the stages asked for
  fits=0
  if [ $# = 0 ]; then
    for n in "${!calls[@]}"; do read -ra call <<< "${calls[n]}"; plan "call-$((n + 1))" "${call[@]}" || fits=1; done
  else plan "this call" "${stages[@]}" || fits=1; fi
  exit $fits
fi

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CAPSROUTE_FORCE_CUDA=1
# The C++ kernels for AVX2, not for whatever this machine's CPU has: a build carried from one call to
# the next may land on a machine kind with another CPU.
export CAPSROUTE_CPU_ARCH=${CAPSROUTE_CPU_ARCH:-x86-64-v3}
export PYTHONUNBUFFERED=1  # logs complete up to the moment a call is cut off
export PIP_RETRIES=0 PIP_TIMEOUT=3  # no network there: a missing package fails at once
# The GPU image puts a wrapper g++ (/opt/gcc) first, whose extension carries a static libstdc++ and
# crashes on the first C++ exception (a refused input): build with the system compiler.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"; fi
build_cache=build-cache/capsroute-build.tar.gz
[ ! -f "$build_cache" ] || tar -xzf "$build_cache"  # env.sh rebuilds if its stamp no longer matches
# A failed build's whole log comes back (the output's tail seldom holds the compiler's error).
[ -z "${OUT:-}" ] || trap 'cp build/build.log "$OUT/" 2>/dev/null || true' EXIT
source scripts/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # a reused build is not pip-installed in the fresh .venv
# The seconds a stage may run: what is left of the call less $1, at most $2 if given; fails, saying so,
# when that is under a minute.
stage_seconds() {
  local seconds=$(( CALL_SECONDS - (SECONDS - started) - $1 ))
  [ -z "${2:-}" ] || [ "$2" -ge "$seconds" ] || seconds=$2
  [ "$seconds" -ge 60 ] || { echo "$stage: no time left in this call (CALL_SECONDS)" >&2; return 1; }
  echo "$seconds"
}
# Runs "$@" in what is left of the stage's time (stage_end): SIGINT at the limit (pytest, the
# benchmark and training stop cleanly on it), SIGKILL 15 s later.
within() {
  local left=$(( stage_end - SECONDS ))
  [ "$left" -gt 0 ] || { echo "$stage: out of time, not run: $*" >&2; return 124; }
  timeout -k 15 -s INT "$left" "$@"
}
# capsroute bench on the GPU, results in $out/$1; the rest: its options.
gpu_bench() {
  local dir=$1; shift
  within python -m capsroute.cli bench --device cuda --no-progress --out "$out/$dir" "$@"
}
run_bytes=$((15 << 20))  # the largest run (checkpoint) brought back, under the 16 MiB a file may be
# Whether run folder $1 has a checkpoint small enough to bring back.
checkpoint_travels() {
  [ -f "$1/checkpoint.pt" ] && [ "$(stat -c %s "$1/checkpoint.pt")" -lt "$run_bytes" ]
}
# Packs what the stages wrote so far into $OUT, each file under a temporary name first ($1: the
# packer's name) so that what comes back is whole. tar's status 1: a file grew while it was read.
pack() {
  tar -czf "$OUT/.cuda-check-$1.tar.gz" -C "$(dirname "$out")" cuda-check || [ $? = 1 ]
  mv -f "$OUT/.cuda-check-$1.tar.gz" "$OUT/cuda-check.tar.gz"
  local run
  for run in runs/*/; do  # checkpoint.pt is replaced by a rename: a tar reads a whole one
    checkpoint_travels "${run%/}" || continue
    tar --exclude='*.tmp' -czf "$OUT/.run-$1.tar.gz" "${run%/}" || [ $? = 1 ]
    mv -f "$OUT/.run-$1.tar.gz" "$OUT/run-$(basename "$run").tar.gz"
  done
}
if [ -n "${OUT:-}" ]; then
  out=$(mktemp -d)/cuda-check
  mkdir -p "$out"
  if [ -f build/build.log ]; then  # built by this call (a carried build has no log)
    cp build/build.log "$out/"  # ptxas' registers and spills per kernel, for the record
    strip --strip-debug capsroute/_C*.so 2>/dev/null || true  # 60% of the file; under the 16 MiB a file may bring back
    tar -czf "$OUT/capsroute-build.tar.gz" capsroute/_C*.so capsroute/_build_config.py build/.capsroute-stamp
  fi
  # SIGTERM waits for a tar or mv in progress (bash runs the trap between commands); the loop's
  # output goes nowhere, so that a sleep it leaves behind holds no pipe of the caller's open.
  ( trap 'kill $! 2>/dev/null; exit 0' TERM
    while :; do sleep 30 & wait $!; pack periodic || true; done ) > /dev/null 2>&1 &
  packer=$!
  trap 'kill $packer 2>/dev/null || true; wait $packer 2>/dev/null || true; pack final || true; rm -f "$OUT"/.*.tar.gz' EXIT
else
  out=bench/results
  mkdir -p "$out"
fi
# Without a visible GPU every CUDA test would skip and the stages would "pass": stop instead.
python -c "import torch, capsroute; assert torch.cuda.is_available() and capsroute.build_info()['cuda'], \
  'no GPU visible to torch, or capsroute built without CUDA'; print(torch.cuda.get_device_name(), torch.__version__)"
status=0
for k in "${!stages[@]}"; do
  stage=${stages[k]}
  [ "$stage" != build ] || continue  # done by env.sh above
  if [[ $stage != train-* ]]; then
    # Its budget, or more where the call has time to spare: what is left of it less 20 s to pack
    # and the budgets of the stages after this one (a stage may use what the ones before it left
    # over, not what the ones after it need); never past the call.
    later=0
    for next in "${stages[@]:k+1}"; do
      case $next in
        build) ;;
        train-*) later=$(( later + 120 )) ;;
        *) later=$(( later + budget[${next%%:*}] )) ;;
      esac
    done
    spare=$(( CALL_SECONDS - (SECONDS - started) - 20 - later ))
    [ "$spare" -gt "${budget[${stage%%:*}]}" ] || spare=${budget[${stage%%:*}]}
    if ! seconds=$(stage_seconds 20 "$spare"); then status=1; continue; fi
    stage_start=$SECONDS stage_end=$(( SECONDS + seconds ))
    echo "== $stage: at most $seconds s" >&2
  fi
  case $stage in
    doctor)  # every op, path and dtype against the reference; the path each ran
      within python -m capsroute.doctor --device cuda --no-progress --json "$out/doctor.json" 2>&1 \
        | tee "$out/doctor.log" || status=1 ;;
    bench-minimal)  # capsroute alone (the baselines: bench-baselines), each path
      mnist=(--impl capsroute --shape mnist --batch 32 512 --repeats 30)
      em=(--impl capsroute --op em --shape em-class em-conv --batch 64 2304 --repeats 30)
      CAPSROUTE_ROUTING_CLUSTER=0 gpu_bench minimal-v2-no-clusters --op dynamic "${mnist[@]}" \
        || status=1
      CAPSROUTE_ROUTING_CLUSTER=force gpu_bench minimal-v2-clusters --op dynamic "${mnist[@]}" \
        || status=1
      gpu_bench minimal-v2 --op dense "${mnist[@]}" || status=1
      gpu_bench minimal-v2 "${em[@]}" || status=1 ;;
    bench-baselines)  # eager and compiled once per minimal shape
      gpu_bench baselines --impl eager compiled --op dynamic dense --shape mnist --batch 32 512 || status=1
      gpu_bench baselines --impl eager compiled --op em --shape em-class --batch 64 || status=1
      gpu_bench baselines --impl eager compiled --op em --shape em-conv --batch 2304 || status=1 ;;
    tests)
      within python -m pytest tests -q -m cuda --ignore=tests/ops/test_scale.py --ignore=tests/train/test_cuda_graph.py 2>&1 \
        | tee "$out/cuda-tests.log" || status=1 ;;
    tests-scale)  # I = 16384 at B = 1 or 2: the row-range path of the routing kernels, with GBs of votes
      within python -m pytest tests/ops/test_scale.py -q -m cuda 2>&1 | tee "$out/cuda-tests-scale.log" || status=1 ;;
    sweep)  # every op (the attention routings too) against the float64 reference at B = 1..2048,
      # I = 16384, EM at B = 64x36; determinism
      within python scripts/gpu_sweep.py --device cuda --out "$out" 2>&1 | tee "$out/gpu-sweep.log" || status=1 ;;
    profile)  # where the missed targets' time goes (profile.txt)
      within python scripts/gpu_profile.py --device cuda --out "$out" || status=1 ;;
    memcheck*|racecheck*|initcheck*|synccheck*)  # TOOL or TOOL:SECTION,SECTION
      tool=${stage%%:*} sections=()
      [ "$tool" = "$stage" ] || IFS=, read -ra sections <<< "${stage#*:}"
      # Without torch's caching allocator: it hands out slices of larger blocks and reuses memory,
      # so an overrun or an uninitialised read inside a block would pass memcheck and initcheck.
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 within compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python scripts/sanitizer_workload.py "${sections[@]}" 2>&1 \
        | tee "$out/sanitizer-${stage//[:,]/-}.log" | tail -8 || status=1 ;;
    bench)  # every impl; other paths capsroute alone (the baselines do not depend on them)
      gpu_bench . --op dynamic dense --shape mnist --batch 32 128 512 2048 --plot || status=1
      # dynamic_routing on the warp rows both ways instead of an element per cluster
      # (docs/kernels.md, CUDA, measured)
      CAPSROUTE_ROUTING_CLUSTER=0 gpu_bench kernels-v2-no-cluster --impl capsroute --op dynamic \
        --shape mnist --batch 32 512 2048 || status=1
      # dense_capsules with chunks of 182 elements (128 MiB of votes, past the 50 MB L2: fewer
      # launches, HBM traffic) against the default 45 (32 MiB, L2-resident).
      CAPSROUTE_DENSE_CHUNK=182 gpu_bench kernels-v2-chunk182 --impl capsroute --op dense \
        --shape mnist --batch 512 2048 || status=1 ;;
    bench-em)  # every impl
      gpu_bench . --op em em-pose --plot || status=1 ;;
    bench-large)
      gpu_bench . --op dynamic dense --shape large --batch 32 128 --plot || status=1 ;;
    bench-scale)
      gpu_bench . --op dynamic dense --shape scale-100 scale-1000 --batch 1 4 16 --plot || status=1 ;;
    bench-models)
      gpu_bench . --op capsnet matrixcapsnet --max-batch --plot || status=1 ;;
    graph-step)  # the training step in one CUDA graph against the eager step, on the epoch's time
      within python -m pytest tests/train/test_cuda_graph.py -q -m cuda 2>&1 | tee "$out/cuda-graph-tests.log" || status=1
      for mode in eager graph; do
        flag=(); [ "$mode" = eager ] || flag=(--cuda-graph)
        within python -m capsroute.train --model capsnet --dataset mnist --data-dir data/mnist --epochs 3 \
          --batch-size 128 --out "runs/graph-step-$mode" --no-progress --no-plots "${flag[@]}" 2>&1 \
          | tee "$out/graph-step-$mode.log" || status=1
        cp "runs/graph-step-$mode/metrics.json" "$out/graph-step-$mode-metrics.json" 2>/dev/null || true
      done ;;
    bench-attention)  # every impl, the vote-input ops and their dense forms on the same tensors
      attention=(--op self-attention inverted-attention dense-self-attention dense-inverted-attention)
      gpu_bench attention "${attention[@]}" --shape efficientcapsnet mnist --batch 32 512 || status=1
      gpu_bench attention "${attention[@]}" --shape large-16k --batch 8 || status=1
      # the dense forms in chunks of 182 elements (as dense_capsules' chunk182 row): their block
      # kernels' row ranges and reduce launches, a chunk at a time, against the default 45
      CAPSROUTE_DENSE_CHUNK=182 gpu_bench attention-chunk182 --impl capsroute \
        --op dense-self-attention dense-inverted-attention --shape mnist --batch 512 || status=1 ;;
    bench-conv)  # every impl; conv EM's kernel against its prediction (docs/kernels.md)
      gpu_bench conv --op conv-em --shape mcn-conv1 mcn-conv2 --batch 512 || status=1
      gpu_bench conv --op conv-em conv-dynamic --shape conv-image --batch 1 || status=1
      gpu_bench conv --op conv-dynamic --shape segcaps --batch 16 || status=1
      # conv_dynamic_routing an image a chunk (4096 positions, 145 MB at segcaps, past the 50 MB
      # L2) against the default 896 positions (32 MiB): 16 chunks instead of 80, their launches
      CAPSROUTE_CONV_CHUNK=4096 gpu_bench conv-chunk4096 --impl capsroute --op conv-dynamic \
        --shape segcaps --batch 16 || status=1
      # its chunks' routing on the warp rows: clusters of 8 and 16 blocks over elements of 8
      # children read their votes at under 1% of the bandwidth (profile.txt at 9465c6f)
      CAPSROUTE_ROUTING_CLUSTER=0 gpu_bench conv-no-cluster --impl capsroute --op conv-dynamic \
        --shape segcaps --batch 16 || status=1 ;;
    train-*)  # train-MODEL (MNIST), train-MODEL-fashion (Fashion-MNIST), train-MODEL-multimnist (pairs)
      spec=${stage#train-}; model=${spec%%-*}; dataset=mnist
      case $spec in *-fashion) dataset=fashion-mnist ;; *-multimnist) dataset=multimnist ;; esac
      case $model-$dataset in capsnet-*|matrixcapsnet-mnist|matrixcapsnet-fashion-mnist|cnn-multimnist) ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;; esac
      data_dir=data/$dataset; [ "$dataset" != multimnist ] || data_dir=data/mnist
      run=runs/$model-$dataset
      if [ -f "$run/checkpoint.pt" ]; then args=(--resume "$run")
      elif [ "$dataset" = multimnist ]; then  # CapsNet, or the CNN baseline (--model cnn), on the same pairs
        args=(--model "$model" --dataset multimnist --data-dir "$data_dir" --pairs-per-digit "${PAIRS_PER_DIGIT:-10}"
              --epochs 100 --batch-size 128 --out "$run")
      elif [ "$model" = capsnet ]; then args=(--model capsnet --dataset "$dataset" --data-dir "$data_dir" --epochs 100
                                             --batch-size 128 --out "$run")
      # The recipe that public re-implementations report 99.3% with: A=B=C=D=32, 2 iterations, Adam 1e-2, batch 128.
      else args=(--model matrixcapsnet --model-config A=32 B=32 C=32 D=32 iters=2 --dataset "$dataset"
                 --data-dir "$data_dir" --epochs 40 --batch-size 128 --lr 1e-2 --out "$run"); fi
      rc=0  # a minute of the call left to save the checkpoint and pack
      if seconds=$(stage_seconds 60 "${TRAIN_SECONDS:-}"); then
        timeout -k 30 -s INT "$seconds" python -m capsroute.train "${args[@]}" --no-progress 2>&1 | tee -a "$out/$model-$dataset-train.log" || rc=$?
      else rc=1; fi
      [ "$rc" = 0 ] || [ "$rc" = 124 ] || status=1   # 124: paused by the time limit, resumable
      if [ -n "${OUT:-}" ] && [ -f "$run/checkpoint.pt" ] && ! checkpoint_travels "$run"; then
        echo "$run/checkpoint.pt is too large to bring back: this run cannot resume in another call" >&2
      fi
      mkdir -p "$out/$model-$dataset" && cp "$run"/*.json "$run"/*.csv "$run"/*.png "$out/$model-$dataset/" 2>/dev/null || true
      if [ "$model" = matrixcapsnet ] && [ -f "$run/result.json" ]; then  # a finished run must reach the GPU target
        target=0.994; [ "$dataset" = mnist ] || target=0.90
        python -c "import json, sys; a = json.load(open('$run/result.json'))['test_accuracy']
print(f'$model $dataset: test accuracy {a:.4f}, target $target'); sys.exit(a < $target)" || status=1
      fi ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  [[ $stage == train-* ]] || echo "== $stage: took $(( SECONDS - stage_start )) s" >&2
  [ -z "${OUT:-}" ] || pack stage || true  # what the stage wrote comes back even if the call is cut off later
done
exit $status
