#!/usr/bin/env bash
# The routing benchmark at the MNIST DigitCaps shape on whatever device is here: capsroute vs
# the plain PyTorch reference, eager and under torch.compile. Prints a table and writes JSON
# under bench/results/. Extra arguments go to `capsroute bench` (e.g. --plot; see bench/README.md).
source "$(dirname "$0")/env.sh"
python -m capsroute.cli bench --device auto --op dynamic dense --shape mnist "$@"
