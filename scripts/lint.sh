#!/usr/bin/env bash
# Lint and format check at 100 columns: ruff for Python (pyproject.toml's [tool.ruff]) and
# clang-format for the C++ and CUDA of csrc/ and tests/emulator/ (.clang-format).
#   bash scripts/lint.sh         fails on a lint error or on a file a formatter would change
#   bash scripts/lint.sh --fix   applies ruff's safe fixes (import order) and both formatters,
#                                then checks what is left
# The tools are .venv's, the versions scripts/env.sh pins: formatters change their output between
# versions.
set -euo pipefail
cd "$(dirname "$0")/.."

fix=false
case "${1:-}" in
  "") ;;
  --fix) fix=true ;;
  *) echo "lint.sh: unknown argument '$1' (the only option is --fix)" >&2; exit 2 ;;
esac
if [ -d .venv/bin ]; then PATH="$PWD/.venv/bin:$PATH"; fi
for tool in ruff clang-format; do
  if ! command -v "$tool" > /dev/null; then
    echo "lint.sh: no $tool: scripts/env.sh installs it" >&2
    exit 1
  fi
done
mapfile -t cxx_files < <(git ls-files csrc tests/emulator | grep -E '\.(h|cpp|cu|cuh)$')

if $fix; then
  ruff check --fix --quiet . || true  # what it cannot fix, the check below reports
  ruff format --quiet .
  clang-format -i "${cxx_files[@]}"
fi
failed=0
ruff check --quiet . || failed=1
ruff format --check --quiet . || failed=1
clang-format --dry-run --Werror "${cxx_files[@]}" || failed=1
if [ "$failed" = 1 ] && ! $fix; then
  echo "lint.sh: run scripts/lint.sh --fix to apply the formatters" >&2
fi
exit "$failed"
