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

# ---- Debian packages ----
pkgs=(cmake ninja-build g++ libboost-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgloo-dev libssl-dev
      liblmdb-dev libgtest-dev libgmock-dev clang libclang-rt-14-dev zlib1g-dev)
missing=()
command -v python3 >/dev/null || missing+=(python3 python3-pip)
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# ---- LibTorch: the PyPI torch wheel, pinned ----
if ! python3 -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "== installing torch==$TORCH_VERSION (pip)"
  # Debian's own python3 marks itself externally managed; a pyenv/venv python does not.
  python3 -m pip install -q "torch==$TORCH_VERSION" ||
    python3 -m pip install -q --break-system-packages "torch==$TORCH_VERSION"
fi
# mpmath (tests/losses/reference.py's exact values) comes with torch through sympy; make sure.
if ! python3 -c "import mpmath" 2>/dev/null; then
  python3 -m pip install -q mpmath || python3 -m pip install -q --break-system-packages mpmath
fi

# matplotlib draws the demo's plot (examples/gpt/plot.py).
if ! python3 -c "import matplotlib" 2>/dev/null; then
  echo "== installing matplotlib (pip)"
  python3 -m pip install -q matplotlib || python3 -m pip install -q --break-system-packages matplotlib
fi

# lizard measures function lengths for tests/structure (no library function over 80 lines).
if ! python3 -c "import lizard" 2>/dev/null; then
  echo "== installing lizard (pip)"
  python3 -m pip install -q lizard || python3 -m pip install -q --break-system-packages lizard
fi

# transformers and tokenizers (the package's [hf] extra): the Hugging Face tests and examples/llm.
if ! python3 -c "import transformers, tokenizers" 2>/dev/null; then
  echo "== installing transformers tokenizers (pip)"
  python3 -m pip install -q transformers tokenizers ||
    python3 -m pip install -q --break-system-packages transformers tokenizers
fi

# pytest runs the Python tests; scikit-build-core builds the Python package (pip install .).
for m in pytest:pytest scikit_build_core:scikit-build-core; do
  if ! python3 -c "import ${m%%:*}" 2>/dev/null; then
    echo "== installing ${m#*:} (pip)"
    python3 -m pip install -q "${m#*:}" || python3 -m pip install -q --break-system-packages "${m#*:}"
  fi
done

# ---- configure (once) and build ----
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDISTILL_BUILD_FUZZ=ON
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
