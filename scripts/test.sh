#!/usr/bin/env bash
# The test suite on whatever is here: CPU always, CUDA tests too when a GPU is present.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m cuda`).
source "$(dirname "$0")/env.sh"
python -m pytest tests -q "$@"
