#!/usr/bin/env bash
# What a machine with a GPU should run, stage by stage (default: tests sweep sanitize bench): the CUDA
# tests, the float64 correctness sweep at GPU sizes (scripts/gpu_sweep.py), compute-sanitizer over
# scripts/sanitizer_workload.py, then the benchmark.
#   bash scripts/cuda_check.sh [tests] [tests-scale] [sweep] [sanitize] [bench] [bench-em] [bench-large] [bench-scale] [bench-models]
#                              [train-capsnet[-fashion|-multimnist]] [train-matrixcapsnet[-fashion]] [train-cnn-multimnist]
# The train stages (train-MODEL for MNIST, train-MODEL-fashion for Fashion-MNIST, train-MODEL-multimnist
# for MultiMNIST pairs, PAIRS_PER_DIGIT x 60,000 an epoch, default 10) need the data in data/mnist or
# data/fashion-mnist (git-ignored: copy ../shared/data/<name> there and carry "data" to the GPU
# machine). A run trains until CALL_SECONDS after the script started, less a minute (at most
# TRAIN_SECONDS, if set), then stops with a checkpoint (SIGINT is taken between steps); the next call
# resumes the run in runs/. CALL_SECONDS (default 570) must be what the call may run: through the
# device tool, its timeout_s or the device time left, whichever is less, less 30 s.
#
# Without OUT, logs, JSON and figures go to bench/results. With OUT (the device tool's output folder,
# which brings back at most 8 files, from a machine that starts bare on every call):
# - everything the stages write is packed into $OUT/cuda-check.tar.gz every 30 s and at the end, so
#   a call cut off by its time limit still brings back what its stages wrote until then;
# - a build made by this call is packed into $OUT/capsroute-build.tar.gz: put it in build-cache/
#   (git-ignored) and carry "build-cache", and the next call unpacks it and skips the build (2 min
#   15 s on 2 cores) when the sources, build settings and torch are unchanged;
# - a run whose checkpoint is under 15 MiB (MatrixCapsNet's, not CapsNet's) is packed with the rest,
#   as $OUT/run-MODEL-DATASET.tar.gz: unpack it here and carry "runs/MODEL-DATASET" to resume it.
started=$SECONDS
cd "$(dirname "$0")/.."
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CAPSROUTE_FORCE_CUDA=1
# The C++ kernels for AVX2, not for whatever this machine's CPU has: a build carried from one call to
# the next may land on a machine kind with another CPU.
export CAPSROUTE_CPU_ARCH=${CAPSROUTE_CPU_ARCH:-x86-64-v3}
export PYTHONUNBUFFERED=1  # logs complete up to the moment a call is cut off
build_cache=build-cache/capsroute-build.tar.gz
[ ! -f "$build_cache" ] || tar -xzf "$build_cache"  # env.sh rebuilds if its stamp no longer matches
# A failed build's whole log comes back (the output's tail seldom holds the compiler's error).
[ -z "${OUT:-}" ] || trap 'cp build/build.log "$OUT/" 2>/dev/null || true' EXIT
source scripts/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # a reused build is not pip-installed in the fresh .venv
# The seconds a stage may run: what is left of the call less $1, at most $2 if given; fails, saying so,
# when that is under a minute.
stage_seconds() {
  local seconds=$(( ${CALL_SECONDS:-570} - (SECONDS - started) - $1 ))
  [ -z "${2:-}" ] || [ "$2" -ge "$seconds" ] || seconds=$2
  [ "$seconds" -ge 60 ] || { echo "$stage: no time left in this call (CALL_SECONDS)" >&2; return 1; }
  echo "$seconds"
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
stages=${*:-tests sweep sanitize bench}
status=0
for stage in $stages; do
  case $stage in
    tests)  # then the routing and EM tests again on the v2 kernel set
      python -m pytest tests -q -m cuda --ignore=tests/test_scale.py 2>&1 | tee "$out/cuda-tests.log" || status=1
      CAPSROUTE_CUDA_KERNELS=v2 python -m pytest tests -q -m cuda -k "dense or dynamic or em_routing" --ignore=tests/test_scale.py 2>&1 \
        | tee "$out/cuda-tests-kernels-v2.log" || status=1 ;;
    tests-scale)  # I = 16384 at B = 1 or 2: the row-range path of the routing kernels, with GBs of votes
      if seconds=$(stage_seconds 30); then
        timeout -k 30 -s INT "$seconds" python -m pytest tests/test_scale.py -q -m cuda 2>&1 | tee "$out/cuda-tests-scale.log" || status=1
      else status=1; fi ;;
    sweep)  # every op against the float64 reference at B = 1..2048, I = 16384, EM at B = 64x36; determinism
      python scripts/gpu_sweep.py --device cuda --out "$out" 2>&1 | tee "$out/gpu-sweep.log" || status=1
      # The v2 kernel set (dense_capsules, dynamic_routing's vote gradient, EM's row ranges) through the same cases.
      CAPSROUTE_CUDA_KERNELS=v2 python scripts/gpu_sweep.py --device cuda --match MNIST em_routing --out "$out/kernels-v2" 2>&1 \
        | tee "$out/gpu-sweep-kernels-v2.log" || status=1 ;;
    sanitize)
      # All four tools by default; SANITIZER_TOOLS picks some (each is a full pass of the workload).
      for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
        # Without torch's caching allocator: it hands out slices of larger blocks and reuses memory,
        # so an overrun or an uninitialised read inside a block would pass memcheck and initcheck.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitizer_workload.py 2>&1 \
          | tee "$out/sanitizer-$tool.log" | tail -5 || status=1
      done ;;
    bench)
      python -m capsroute.cli bench --device cuda --op dynamic dense --shape mnist --batch 32 128 512 2048 --no-progress --plot --out "$out" || status=1
      # Both kernel sets side by side until one is dropped (bench/NOTES.md, GPU section 3).
      CAPSROUTE_CUDA_KERNELS=v2 python -m capsroute.cli bench --device cuda --op dynamic dense --shape mnist --batch 32 128 512 2048 \
        --no-progress --plot --out "$out/kernels-v2" || status=1
      # v2's dynamic_routing on the warp rows both ways instead of an element per cluster (bench/NOTES.md, GPU sections 7-8)
      CAPSROUTE_CUDA_KERNELS=v2 CAPSROUTE_ROUTING_CLUSTER=0 python -m capsroute.cli bench --device cuda --op dynamic --shape mnist \
        --batch 32 512 2048 --impl capsroute --no-progress --out "$out/kernels-v2-no-cluster" || status=1
      # v2 with chunks of 182 elements (128 MiB of votes, past the 50 MB L2: fewer launches, HBM traffic)
      # against the default 45 (32 MiB, L2-resident).
      CAPSROUTE_CUDA_KERNELS=v2 CAPSROUTE_DENSE_CHUNK=182 python -m capsroute.cli bench --device cuda --op dense --shape mnist \
        --batch 512 2048 --impl capsroute --no-progress --out "$out/kernels-v2-chunk182" || status=1 ;;
    bench-em)  # both kernel sets: v1's one block per element, v2's row ranges
      python -m capsroute.cli bench --device cuda --op em em-pose --no-progress --plot --out "$out" || status=1
      CAPSROUTE_CUDA_KERNELS=v2 python -m capsroute.cli bench --device cuda --op em em-pose --no-progress --plot \
        --out "$out/kernels-v2" || status=1 ;;
    bench-large)
      python -m capsroute.cli bench --device cuda --op dynamic dense --shape large --batch 32 128 --no-progress --plot --out "$out" || status=1 ;;
    bench-scale)
      python -m capsroute.cli bench --device cuda --op dynamic dense --shape scale-100 scale-1000 --batch 1 4 16 --no-progress --plot --out "$out" || status=1 ;;
    bench-models)
      python -m capsroute.cli bench --device cuda --op capsnet matrixcapsnet --max-batch --no-progress --plot --out "$out" || status=1 ;;
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
done
exit $status
