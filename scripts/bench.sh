#!/usr/bin/env bash
# The routing benchmark at the MNIST DigitCaps shape on whatever device is here: capsroute vs
# the plain PyTorch reference, eager and under torch.compile. Prints a table and writes JSON
# under bench/results/. Extra arguments go to bench/routing_bench.py.
source "$(dirname "$0")/env.sh"
python bench/routing_bench.py --device auto --shape mnist "$@"
