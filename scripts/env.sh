# Sourced by scripts/test.sh and scripts/bench.sh: everything a fresh machine needs.
# Makes .venv (reusing the machine's own torch if it has one, as the GPU machines do, else
# installing torch 2.14.1), installs what is missing, and builds capsroute._C when its sources
# or build settings changed since the last build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PYTHON" -c "import sys, torch; sys.exit(sys.prefix == sys.base_prefix)" 2>/dev/null; then
    # $PYTHON is a venv's and has torch (the GPU machines' python3 is): use that venv. One made from
    # it would see its base interpreter's packages, not its torch.
    ln -s "$("$PYTHON" -c "import sys; print(sys.prefix)")" .venv
  elif "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate

python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${CAPSROUTE_TORCH_VERSION:-2.14.1}"
missing=$(python - <<'PY'
import importlib.util
wanted = {"numpy": "numpy", "pybind11": "pybind11", "ninja": "ninja", "setuptools": "setuptools", "wheel": "wheel",
          "pytest": "pytest", "hypothesis": "hypothesis", "pytest_benchmark": "pytest-benchmark", "tqdm": "tqdm",
          "matplotlib": "matplotlib",
          # scripts/lint.sh's formatters, pinned: their output changes between versions
          "ruff": "ruff==0.17.6", "clang_format": "clang-format==23.1.5"}
print(" ".join(pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)
# The GPU machines have no network: what can't be installed there is reported, not fatal (the
# build needs none of the test and plotting packages; a test that needs one then fails).
if [ -n "$missing" ]; then python -m pip install -q $missing || echo "warning: could not install: $missing" >&2; fi

if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

# pip rebuilds every object on each editable install: build only when something changed (the
# settings setup.py reads count; run-time switches such as CAPSROUTE_ROUTING_CLUSTER do not).
stamp=$( { cat setup.py pyproject.toml capsroute/_cpu_arch.py; find csrc -type f | sort | xargs cat;
           env | grep -E '^(CAPSROUTE_(FORCE_CPU|FORCE_CUDA|CPU_ARCH)|TORCH_CUDA_ARCH_LIST|CUDA_HOME)=' | sort;
           python -c "import torch; print(torch.__version__)"; } | sha256sum | cut -c1-16)
if [ "$(cat build/.capsroute-stamp 2>/dev/null)" != "$stamp" ] || ! python -c "import capsroute" 2>/dev/null; then
  echo "building capsroute._C (MAX_JOBS=$MAX_JOBS) ..." >&2
  # The compiler's output (ptxas' per-kernel report included) goes to build/build.log.
  mkdir -p build
  python -m pip install -v --no-build-isolation --no-deps -e . > build/build.log 2>&1 \
    || { tail -n 40 build/build.log >&2; grep -m 20 -E "error|FAILED" build/build.log >&2
         echo "build failed: the first errors above, the whole log in build/build.log" >&2; exit 1; }
  # A refused input must reach Python as a RuntimeError. A compiler that links a static libstdc++
  # into the extension (a wrapper g++ some images put first) builds one that crashes there instead.
  python -c "import torch, capsroute
try: capsroute.squash(torch.ones(1), eps=float('nan'))
except RuntimeError: pass" || { echo "the build crashes on a C++ exception: build with the system" \
    "compiler (CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED='/usr/bin/g++ -shared')" >&2; exit 1; }
  echo "$stamp" > build/.capsroute-stamp
fi
python -c "import capsroute, json; print('capsroute', json.dumps(capsroute.build_info()))"
