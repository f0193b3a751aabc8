#!/usr/bin/env bash
# MultiMNIST (README: "MultiMNIST: two overlapping digits"): CapsNet and the plain CNN baseline
# trained on the same pairs in the same order (same seed) and scored on the same fixed test pairs.
#
#   bash scripts/multimnist.sh                  one epoch of 60,000 pairs each, scored on all 10,000 test pairs
#   STEPS=100 TEST_PAIRS=2000 bash scripts/multimnist.sh   stop both after 100 steps of 128 pairs (the
#                                               same 12,800 pairs) and score them with --evaluate
#
# Runs go to runs/<model>-multimnist-$DEVICE/ and continue where they stopped when run again.
# DEVICE (default auto), PAIRS_PER_DIGIT (default 1: 60,000 pairs an epoch), $CAPSROUTE_DATA/mnist
# (default data/mnist) holds the MNIST IDX files. A CapsNet step of 128 pairs costs about 10
# CPU-seconds (the 256->256 9x9 primary convolution over a 10x10 grid is most of it).
source "$(dirname "$0")/env.sh"
DEVICE=${DEVICE:-auto}
for model in capsnet cnn; do
  out=runs/$model-multimnist-$DEVICE
  if [ -f "$out/checkpoint.pt" ]; then
    run=(--resume "$out")
  else
    run=(--model "$model" --dataset multimnist --data-dir "${CAPSROUTE_DATA:-data}/mnist"
         --pairs-per-digit "${PAIRS_PER_DIGIT:-1}" --epochs 1 --batch-size 128 --device "$DEVICE" --out "$out")
  fi
  python -m capsroute.train "${run[@]}" ${STEPS:+--max-steps "$STEPS"}
  if [ -n "${STEPS:-}" ]; then
    python -m capsroute.train --resume "$out" --evaluate ${TEST_PAIRS:+--test-subset "$TEST_PAIRS"}
  fi
done
