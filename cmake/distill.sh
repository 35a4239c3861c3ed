#!/usr/bin/env bash
# The README's two commands:
#   bash cmake/distill.sh demo   installs what is missing, builds, runs the main job
#   bash cmake/distill.sh test   installs what is missing, builds, runs every test
# Running either again is quick: installs and configure are skipped when done,
# the build is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
case "$what" in demo|test) ;; *) echo "usage: $0 demo|test" >&2; exit 2 ;; esac

TORCH_VERSION=2.11.0
BUILD=${DISTILL_BUILD_DIR:-build}
JOBS=${DISTILL_JOBS:-$(nproc)}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo

# Each install is said before it is done: which packages, with what, into which interpreter.
# ---- Debian packages ----
pkgs=(cmake ninja-build g++ libboost-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgloo-dev libssl-dev
      liblmdb-dev libgtest-dev libgmock-dev clang libclang-rt-14-dev zlib1g-dev)
missing=()
command -v python3 >/dev/null || missing+=(python3 python3-pip)
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get: installing ${#missing[@]} Debian packages${SUDO:+ (with sudo)}: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# ---- Python packages, into the python3 on PATH ----
# torch==$TORCH_VERSION: LibTorch (the PyPI wheel, pinned); mpmath: tests/loss/reference.py's
# exact values; matplotlib: the demo's plot; lizard: tests/structure's function lengths;
# transformers, tokenizers: the [hf] extra (the Hugging Face tests, examples/llm); pytest, mypy:
# the [test] extra (tests/python, test_typing.py); scikit-build-core: pip install --no-build-isolation . of the package.
has() { python3 -c "import $1" 2>/dev/null; }
pip_missing=()
python3 -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" \
  2>/dev/null || pip_missing+=("torch==$TORCH_VERSION")
for m in mpmath:mpmath matplotlib:matplotlib lizard:lizard transformers:transformers tokenizers:tokenizers \
         pytest:pytest mypy:mypy scikit_build_core:scikit-build-core; do
  has "${m%%:*}" || pip_missing+=("${m#*:}")
done
if [ ${#pip_missing[@]} -gt 0 ]; then
  where=$(python3 -c "import sys, sysconfig; print(f'{sys.executable} (Python {sys.version.split()[0]}, \
packages in {sysconfig.get_path(\"purelib\")})')")
  pip_args=(-q)
  # Debian's own python3 is externally managed (PEP 668): pip refuses it unless told to
  # --break-system-packages. Said here, and DISTILL_NO_SYSTEM_PIP=1 stops instead.
  if python3 -c "import os, sys, sysconfig; sys.exit(0 if sys.prefix == sys.base_prefix and \
os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) else 1)"; then
    if [ "${DISTILL_NO_SYSTEM_PIP:-0}" = 1 ]; then
      echo "error: $where is externally managed (PEP 668) and DISTILL_NO_SYSTEM_PIP=1: install ${pip_missing[*]}" \
           "yourself, or activate a virtual environment (python3 -m venv .venv && . .venv/bin/activate) and rerun" >&2
      exit 1
    fi
    echo "== pip: $where is the system's, marked externally managed (PEP 668): pip runs with" \
         "--break-system-packages (a virtual environment avoids this; DISTILL_NO_SYSTEM_PIP=1 stops here instead)"
    pip_args+=(--break-system-packages)
  fi
  echo "== pip: installing ${pip_missing[*]} into $where"
  python3 -m pip install "${pip_args[@]}" "${pip_missing[@]}"
fi

# ---- configure (once) and build ----
# Clang (installed above for the fuzz target) unless CC/CXX say otherwise: with its precompiled
# header a file that includes torch compiles in a third of GCC's time (GCC instantiates the
# header's pending templates again in every file; clang's -fpch-instantiate-templates does it
# once, in the header). RelWithDebInfo with line tables only (-g1: file:line in backtraces, not
# full debug information); each library as one translation unit (DISTILL_UNITY_BUILD). All three
# are for a fast first build; docs/building.md, "Build time", says how to configure otherwise.
if [ ! -f "$BUILD/build.ninja" ]; then
  compilers=()  # for this configure only: pip's builds (tests/python/test_package.py) keep the default
  if [ -z "${CXX:-}" ] && command -v clang++ >/dev/null && command -v clang >/dev/null; then
    compilers=(CC=clang CXX=clang++)
  fi
  echo "== configure: ${compilers[*]:-CXX=${CXX:-the default C++ compiler}} (set CXX and CC to choose another)"
  env "${compilers[@]}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" -DDISTILL_UNITY_BUILD=ON -DDISTILL_BUILD_FUZZ=ON
fi
start=$(date +%s)
cmake --build "$BUILD" -j "$JOBS"
echo "== build: $(( $(date +%s) - start )) s"

case "$what" in
  test)
    start=$(date +%s)
    # -j1: the multi-process tests measure detection times; keep the 2 cores for them.
    status=0
    ctest --test-dir "$BUILD" --output-on-failure --timeout 600 || status=$?
    echo "== C++ tests (ctest): $(( $(date +%s) - start )) s"
    # The Python package of this build (build/python) and its programs; the
    # last test pip-installs a fresh clone into a fresh venv.
    pstart=$(date +%s)
    bdir=$(cd "$BUILD" && pwd)
    PYTHONPATH="$bdir/python" DISTILL_BIN_DIR="$bdir/bin" DISTILL_JOBS="$JOBS" OMP_NUM_THREADS=1 \
      python3 -m pytest tests/python -q -rs -p no:cacheprovider || status=$?
    echo "== Python tests (pytest): $(( $(date +%s) - pstart )) s"
    echo "== tests: $(( $(date +%s) - start )) s"
    exit $status
    ;;
  demo)
    exec bash examples/gpt/demo.sh --build "$BUILD" --config configs/demo.yaml
    ;;
esac
