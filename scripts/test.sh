#!/usr/bin/env bash
# The tests on whatever is here: CPU always, CUDA tests too when a GPU is present.
#   bash scripts/test.sh         the loop to run before every commit (under 5 minutes on 2 cores):
#                                every test but those marked slow
#   bash scripts/test.sh --all   the whole suite, slow tests included (what CI runs: .ci/run)
# Other arguments go to pytest; a -m of your own replaces "not slow" (e.g. `-m cuda`).
source "$(dirname "$0")/env.sh"
if [ "${1:-}" = "--all" ]; then
  shift
  python -m pytest tests -q "$@"
else
  python -m pytest tests -q -m "not slow" "$@"
fi
