#!/usr/bin/env bash
# The GPU check (issue "The GPU path, verified on a GPU"): on a bare GPU machine
# with this working tree, one command that builds distill with CUDA against that
# machine's torch, runs the whole suite (CUDA tests included), the IPC tests
# under compute-sanitizer, the benches and the GPU demo, and writes its results
# to OUT_DIR: results.jsonl (one JSON object per step), one log per step, and the
# benches' JSON lines.
#
#   bash cmake/gpu-check.sh OUT_DIR [--steps build,cuda,sanitize,ring,fused,demo,bench,test,loss,llm | issue41 | issue42 | loan]
#                               [--jobs N] [--step-timeout S] [--deadline S] [--rehearse]
#
# --steps issue41 (the fused loss on CUDA, issue 41): build,loss,fused,llm, each bounded by its own
# limit (configure 60 s, build 240 s, loss 90 s, fused 150 s, llm 240 s: 13 min at worst, so that it
# fits the 15 minutes of a GPU loan with the machine's start; --step-timeout S replaces every limit). Every record line is also appended to
# bench/results/gpu-<device>-<date>.jsonl (tracked; bench/results/gpu-rehearsal-<date>.jsonl under
# --rehearse, not to be committed), with the fused bench's lines.
#
# --steps issue42 (CUDA IPC near the hardware's floor, issue 42): build (only the targets it needs),
# cuda, sanitize, ring (bench_ring_cuda up to 64 MiB on the stream-memory-operation path, then the
# event path up to 16 MiB for comparison), each command bounded by its own limit (700 s in all);
# its lines go to the same ledger, with the ring bench's.
#
# --steps loan (both GPU issues in one device call of at most 10 minutes): build, cuda, sanitize, ring
# (issue 42's), loss, fused, llm, each with the limit its issue gives it, and --deadline 540 unless
# given: a step starts with at most the seconds left before the deadline and none starts in its last
# 20 s (recorded "ok":false, "error":"deadline"). Run it as
#   timeout 580 bash cmake/gpu-check.sh /tmp/gc --steps loan; tar czf $OUT/gc.tgz -C /tmp gc
# (the device tool brings back 8 files at most; the tarball holds every log).
#
# Steps, in the order they run (the default: all of them):
#   build     configure and build with CUDA (unity build, -O2 -g1) against python3's torch
#   cuda      the CUDA tests alone: ipc_cuda_test, student_group_test, student_teacher_head_test (the head
#             shared on a GPU), tests/python/test_cuda.py and test_hf_hidden.py's GPU test
#   sanitize  the IPC tests under compute-sanitizer (memcheck)
#   ring      bench_ring_cuda: CUDA IPC slot bandwidth against cudaMemcpy device to device
#   mps       bench_ring_cuda (up to 64 MiB) with both processes clients of one MPS server
#             (nvidia-cuda-mps-control -d with its own pipe folder, quit after): one context on
#             the GPU instead of two time-sliced ones
#   sweep     bench/fused_linear_gpu.py at chunk_tokens SWEEP_CHUNKS ("512 1024 2048"), with the
#             matrix products alone (gemm_floor): which chunk the CUDA default should take
#   fused     bench/fused_linear_gpu.py: the fused linear loss against materialised logits and
#             Liger-Kernel's fused linear cross-entropy (N 8192, V 128256, bf16)
#   demo      the GPU demo (configs/demo-gpu.yaml), shortened (DEMO_SETS adds --set options)
#   bench     bench_loss, bench_ring, bench_e2e's teacher pool with K = 1, 2, 4
#   test      the whole suite: ctest, then pytest
#   loss      the loss tests on the CUDA build: losses_test, fused_linear_test, vocab_test, cuda_loss_test
#             (a cuda_loss_test that skips on a GPU machine fails the step)
#   llm       examples/llm shortened, its on-policy phase included, the teacher on the GPU (bf16
#             autocast) and the students too (train.py --device cuda): LLM_STEPS (20) steps, LLM_FILES
#             (300) source files; LLM_SETS adds --set options
# Each step is bounded by --step-timeout seconds (default 900); a step cut off is a failure.
#
# --rehearse runs the steps on a machine without a GPU (to check the CPU-side
# steps: unpacking .debs, configuring against them, building); there the CUDA
# tests skip and the GPU benches fail, so only --steps build means anything.
#
# Debian packages the build needs and the machine lacks come from .debs/
# (fetched here by cmake/gpu-fetch-debs.sh) and are unpacked with dpkg -x into
# .deps/root, never into /. Exit status: 0 every step passed, 1 a step failed,
# 2 bad arguments, 3 no GPU visible (nothing is built then).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ALL=build,cuda,sanitize,ring,mps,fused,sweep,demo,bench,test,loss,llm
ISSUE41=build,loss,fused,llm
ISSUE42=build,cuda,sanitize,ring
LOAN=build,cuda,sanitize,ring,loss,fused,llm
# ... and the targets issue 42's build step builds (not the whole tree).
ISSUE42_TARGETS="distill-run distill_python distill_python_files ipc_cuda_test ipc_flag_page_test student_group_test bench_ring_cuda"
LOAN_TARGETS="$ISSUE42_TARGETS distill-teacher losses_test fused_linear_test vocab_test cuda_loss_test"

usage() { echo "usage: $0 OUT_DIR [--steps $ALL] [--jobs N] [--step-timeout S] [--rehearse]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
case "$OUT" in -*|"") usage ;; esac
STEPS=$ALL
STEP_TIMEOUT=
DEADLINE=
JOBS=$(nproc)
REHEARSE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) [ $# -ge 2 ] || usage; STEPS=$2; shift 2 ;;
    --jobs) [ $# -ge 2 ] || usage; JOBS=$2; shift 2 ;;
    --step-timeout) [ $# -ge 2 ] || usage; STEP_TIMEOUT=$2; shift 2 ;;
    --deadline) [ $# -ge 2 ] || usage; DEADLINE=$2; shift 2 ;;
    --rehearse) REHEARSE=1; shift ;;
    *) echo "gpu-check: unknown argument '$1'" >&2; usage ;;
  esac
done
SET=""
case "$STEPS" in issue41) SET=issue41; STEPS=$ISSUE41 ;; issue42) SET=issue42; STEPS=$ISSUE42 ;;
  loan) SET=loan; STEPS=$LOAN; DEADLINE=${DEADLINE:-540} ;; esac
for s in ${STEPS//,/ }; do
  case ",$ALL," in *",$s,"*) ;; *) echo "gpu-check: unknown step '$s' ($ALL)" >&2; exit 2 ;; esac
done
case "${STEP_TIMEOUT:-900}" in ''|*[!0-9]*|0) echo "gpu-check: --step-timeout needs a positive number of seconds, got '$STEP_TIMEOUT'" >&2; exit 2 ;; esac
case "${DEADLINE:-1}" in ''|*[!0-9]*|0) echo "gpu-check: --deadline needs a positive number of seconds, got '$DEADLINE'" >&2; exit 2 ;; esac
T_START=$(date +%s)
case "$JOBS" in ''|*[!0-9]*|0) echo "gpu-check: --jobs needs a positive number, got '$JOBS'" >&2; exit 2 ;; esac
mkdir -p "$OUT" || { echo "gpu-check: cannot create OUT_DIR '$OUT'" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/results.jsonl
: > "$RESULTS"
want() { case ",$STEPS," in *",$1,"*) return 0 ;; esac; return 1; }
# Each step's limit: --step-timeout where given, else the step's own (issue41's steps), else 900 s.
limit_of() {
  [ -n "$STEP_TIMEOUT" ] && { echo "$STEP_TIMEOUT"; return; }
  if [ "$SET" = issue42 ] || { [ "$SET" = loan ] && case "$1" in cuda-*|sanitize-*|bench_ring*) true ;; *) false ;; esac; }; then
    case "$1" in configure) echo 60 ;; build) echo 290 ;; cuda-ctest) echo 90 ;; cuda-pytest) echo 150 ;;
      sanitize-*) echo 60 ;; bench_ring_cuda) echo 50 ;; bench_ring_cuda_events) echo 30 ;; *) echo 900 ;; esac
    return
  fi
  case "$1" in configure) echo 60 ;; build) echo 240 ;; loss) echo 90 ;; fused_linear_gpu) echo 150 ;;
    llm) echo 240 ;; fused_chunk*) echo 90 ;; bench_ring_cuda_mps) echo 60 ;; *) echo 900 ;; esac
}
LEDGER=  # bench/results/gpu-<device>-<date>.jsonl, set once the device is known
record() {  # record STEP OK SECONDS [extra JSON fields]
  local extra=${4:-}
  local line="{\"step\":\"$1\",\"ok\":$2,\"s\":$3${extra:+,$extra}}"
  echo "$line" >> "$RESULTS"
  [ -n "$LEDGER" ] && echo "$line" >> "$LEDGER"
  echo "== $1: ok=$2 (${3} s)"
}
FAILED=0
run_step() {  # run_step NAME COMMAND...: logs to OUT/NAME.log, bounded by its limit (limit_of)
  local name=$1; shift
  local t0=$(date +%s) rc=0 lim
  lim=$(limit_of "$name")
  if [ -n "$DEADLINE" ]; then  # never past the deadline: the step gets what is left, none starts in the last 20 s
    local left=$(( DEADLINE - (t0 - T_START) ))
    if [ "$left" -le 20 ]; then record "$name" false 0 "\"error\":\"deadline\",\"deadline_s\":$DEADLINE"; FAILED=1; return; fi
    [ "$left" -lt "$lim" ] && lim=$left
  fi
  timeout -k 10 "$lim" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  if [ $rc = 0 ]; then record "$name" true $(( $(date +%s) - t0 )) "\"limit_s\":$lim"
  else record "$name" false $(( $(date +%s) - t0 )) "\"rc\":$rc,\"limit_s\":$lim,\"log\":\"$name.log\""; FAILED=1; fi
}

# ---- the machine: a GPU, or nothing to do ----
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ "$REHEARSE" = 1 ]; then
  GPU="none (rehearsal)"
elif [ -z "$GPU" ] || ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no GPU visible (nvidia-smi lists none or torch.cuda.is_available() is false); nothing was built" >&2
  echo "{\"step\":\"gpu\",\"ok\":false,\"error\":\"no GPU visible\"}" >> "$RESULTS"
  exit 3
fi
TORCH=$(python3 -c "import torch; print(torch.__version__)")
# The ledger of this device and day: "NVIDIA H100 80GB HBM3, ..." -> h100.
SLUG=$(echo "${GPU%%,*}" | tr 'A-Z' 'a-z' | grep -oE '[a-z][0-9]{2,4}[a-z]?' | head -1)
[ "$REHEARSE" = 1 ] && SLUG=rehearsal
LEDGER=$REPO/bench/results/gpu-${SLUG:-unknown}-$(date -u +%F).jsonl
mkdir -p "$REPO/bench/results"
echo "{\"step\":\"machine\",\"ok\":true,\"gpu\":\"$GPU\",\"torch\":\"$TORCH\",\"nvcc\":\"$(nvcc --version 2>/dev/null | tail -1)\",\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$(git rev-parse --short HEAD 2>/dev/null)\",\"steps\":\"$STEPS\"}" | tee -a "$LEDGER" >> "$RESULTS"
echo "== GPU: $GPU, torch $TORCH"

# ---- Debian packages from .debs/, unpacked into the repo ----
ROOT=$REPO/.deps/root
if ls .debs/*.deb >/dev/null 2>&1; then
  mkdir -p "$ROOT"
  for d in .debs/*.deb; do dpkg -x "$d" "$ROOT" || { echo "gpu-check: dpkg -x $d failed" >&2; exit 1; }; done
  # Debian's absolute .so links (e.g. libssl.so -> /usr/lib/...) would point outside the unpacked root.
  find "$ROOT" -type l -lname '/*' | while read -r l; do ln -sfn "$ROOT$(readlink "$l")" "$l"; done
fi
MULTI=$ROOT/usr/lib/x86_64-linux-gnu
export CMAKE_PREFIX_PATH=$ROOT/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
export CPATH=$ROOT/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$MULTI${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$MULTI${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMP_NUM_THREADS=1
BUILD=${GPU_CHECK_BUILD_DIR:-$REPO/build-gpu}
# GPU_CHECK_BUILD_LOCK=FILE: the build holds flock FILE (a machine whose cores others share).
LOCK=()
[ -n "${GPU_CHECK_BUILD_LOCK:-${DISTILL_BUILD_LOCK:-}}" ] && LOCK=(flock "${GPU_CHECK_BUILD_LOCK:-$DISTILL_BUILD_LOCK}")

if want build; then
  # The test command's flags (cmake/distill.sh): each library one unit, -O2 with line tables.
  run_step configure cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" -DDISTILL_UNITY_BUILD=ON -DDISTILL_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DDISTILL_BUILD_FUZZ=OFF -DDISTILL_PYTHON=python3
  if [ "$SET" = issue42 ] || [ "$SET" = loan ]; then
    targets=$ISSUE42_TARGETS; [ "$SET" = loan ] && targets=$LOAN_TARGETS
    # shellcheck disable=SC2086 # the target list splits on spaces
    run_step build ${LOCK[@]+"${LOCK[@]}"} cmake --build "$BUILD" -j "$JOBS" --target $targets -- -k 0
  elif ! want test && ! want demo && ! want bench; then  # the device steps alone: the loan's targets
    # shellcheck disable=SC2086 # the target list splits on spaces
    run_step build ${LOCK[@]+"${LOCK[@]}"} cmake --build "$BUILD" -j "$JOBS" --target $LOAN_TARGETS -- -k 0
  else
    run_step build ${LOCK[@]+"${LOCK[@]}"} cmake --build "$BUILD" -j "$JOBS" -- -k 0  # -k 0: build all that builds, list every error
  fi
fi
[ -x "$BUILD/bin/distill-run" ] || { echo "gpu-check: no build in $BUILD (run the build step)" >&2; exit 1; }
# The build tree's Python package; wheels carried in .whl/ (Liger-Kernel for the fused step) go
# to a folder of their own, never into the machine's site-packages.
export PYTHONPATH=$BUILD/python DISTILL_BIN_DIR=$BUILD/bin DISTILL_SOURCE_DIR=$REPO
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$REPO/.deps/site" .whl/*.whl &&
    PYTHONPATH=$PYTHONPATH:$REPO/.deps/site
fi

if want cuda; then
  run_step cuda-ctest ctest --test-dir "$BUILD" --output-on-failure --timeout 300 -R "^(ipc_cuda_test|student_group_test|ipc_flag_page_test|student_teacher_head_test)$"
  run_step cuda-pytest python3 -m pytest -x -q -rs tests/python/test_cuda.py \
    "tests/python/test_hf_hidden.py::test_cuda_students_share_one_copy_of_the_head_on_their_gpu_and_train_as_full_logits"
fi


if want sanitize; then
  # On PATH, or where the CUDA toolkit keeps it.
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$SANITIZER" ]; then
    for t in ipc_cuda_test; do
      exe=$(find "$BUILD" -type f -name "$t" -perm -u+x | head -1)
      [ -n "$exe" ] || { record "sanitize-$t" false 0 '"error":"binary not built"'; FAILED=1; continue; }
      # --target-processes all: the CUDA test re-executes itself as student and teacher.
      run_step "sanitize-$t" "$SANITIZER" --tool memcheck --target-processes all --error-exitcode 9 "$exe"
    done
  else
    record sanitize false 0 '"error":"compute-sanitizer not on PATH nor in /usr/local/cuda"'; FAILED=1
  fi
fi

if want ring; then
  if [ "$SET" = issue42 ] || [ "$SET" = loan ]; then  # up to 64 MiB (the >= 16 MiB ratio), then the event path for comparison
    # DISTILL_CUDA_IPC_TIMES=1: each ring end logs its CUDA calls' host times when it closes (in the .log).
    run_step bench_ring_cuda env DISTILL_CUDA_IPC_TIMES=1 "$BUILD/bin/bench_ring_cuda" --max-mib 64
    run_step bench_ring_cuda_events env DISTILL_CUDA_IPC_TIMES=1 "$BUILD/bin/bench_ring_cuda" --max-mib 16 --signal events
  else
    run_step bench_ring_cuda "$BUILD/bin/bench_ring_cuda" --max-mib 1024
  fi
  for f in bench_ring_cuda bench_ring_cuda_events; do
    [ -f "$OUT/$f.log" ] && grep '^{' "$OUT/$f.log" > "$OUT/$f.jsonl" && cat "$OUT/$f.jsonl" >> "$LEDGER"
  done
fi

if want mps; then
  MPSCTL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control \
    /usr/bin/nvidia-cuda-mps-control 2>/dev/null | head -1)
  if [ -n "$MPSCTL" ]; then
    # A pipe folder of its own: only the processes given it (this step's) are the server's clients.
    mkdir -p /tmp/distill-mps/pipe /tmp/distill-mps/log
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/distill-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/distill-mps/log
    if "$MPSCTL" -d; then
      run_step bench_ring_cuda_mps env DISTILL_CUDA_IPC_TIMES=1 "$BUILD/bin/bench_ring_cuda" --max-mib 64
      echo quit | timeout 20 "$MPSCTL" || true
      [ -f "$OUT/bench_ring_cuda_mps.log" ] && grep '^{' "$OUT/bench_ring_cuda_mps.log" |
        sed 's/^{"bench":"ring_cuda"/{"bench":"ring_cuda","mps":true/' > "$OUT/bench_ring_cuda_mps.jsonl" &&
        cat "$OUT/bench_ring_cuda_mps.jsonl" >> "$LEDGER"
    else
      record mps false 0 '"error":"nvidia-cuda-mps-control -d failed"'; FAILED=1
    fi
    cp /tmp/distill-mps/log/*.log "$OUT/" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    record mps false 0 '"error":"nvidia-cuda-mps-control not found"'; FAILED=1
  fi
fi

if want loss; then
  run_step loss ctest --test-dir "$BUILD" -V --timeout 85 -j 4 \
    -R "^(losses_test|fused_linear_test|vocab_test|cuda_loss_test)$"
  # On a GPU machine the CUDA cases must run, not skip.
  if [ "$REHEARSE" = 0 ] && grep -q "SKIPPED.*CudaLoss\|CudaLoss.*SKIPPED" "$OUT/loss.log"; then
    record loss-cuda-ran false 0 '"error":"cuda_loss_test skipped on a GPU machine"'; FAILED=1
  fi
  grep -E "cases: worst loss rel" "$OUT/loss.log" | sed 's/^/{"step":"loss-summary","text":"/; s/$/"}/' >> "$LEDGER" || true
fi

if want fused; then
  run_step fused_linear_gpu python3 bench/fused_linear_gpu.py --reps 3 --out "$OUT/fused_linear_gpu.jsonl"
  [ -f "$OUT/fused_linear_gpu.jsonl" ] && cat "$OUT/fused_linear_gpu.jsonl" >> "$LEDGER"
fi

if want sweep; then
  for c in ${SWEEP_CHUNKS:-512 1024 2048}; do
    run_step "fused_chunk$c" python3 bench/fused_linear_gpu.py --reps 3 --chunk-tokens "$c" \
      --variants eager_ce,liger_flce,distill_fused,distill_fused_full,distill_fused_jsd,gemm_floor \
      --out "$OUT/fused_chunk$c.jsonl"
    [ -f "$OUT/fused_chunk$c.jsonl" ] && sed "s/^{/{\"chunk_tokens\":$c,/" "$OUT/fused_chunk$c.jsonl" >> "$LEDGER"
  done
fi

if want llm; then
  # Teacher and students on the GPU, shortened: LLM_STEPS steps of 2 students, the on-policy phase too.
  run_step llm env STEPS="${LLM_STEPS:-20}" TEACHER_STEPS="${LLM_STEPS:-20}" ONPOLICY=1 OUT="$OUT/llm" \
    DISTILL_BUILD_DIR="$BUILD" ARGS="--max-files ${LLM_FILES:-300} --eval-tokens 4096 --device cuda" \
    SETS="--set teacher.device=cuda --set teacher.autocast=bfloat16 --set student.device=cuda ${LLM_SETS:-}" \
    bash examples/llm/run.sh
  [ -f "$OUT/llm/llm.json" ] && python3 -c 'import json, sys; print(json.dumps({"step": "llm-result", "result": json.load(open(sys.argv[1]))}))' \
    "$OUT/llm/llm.json" >> "$LEDGER"  # one line (llm.json is indented)
fi

if want demo; then
  if [ -f configs/demo-gpu.yaml ]; then
    rm -rf logs/demo-gpu
    # shellcheck disable=SC2086 # DEMO_SETS: --set options, split on spaces
    run_step demo bash examples/gpt/demo.sh --build "$BUILD" --config configs/demo-gpu.yaml ${DEMO_SETS:-}
    for f in summary.json val_loss.png; do [ -f "logs/demo-gpu/$f" ] && cp "logs/demo-gpu/$f" "$OUT/demo-$f"; done
  else
    record demo false 0 '"error":"configs/demo-gpu.yaml missing"'; FAILED=1
  fi
fi

if want bench; then
  run_step bench_loss "$BUILD/bin/bench_loss"
  run_step bench_ring "$BUILD/bin/bench_ring"
  # The teacher pool's K-scaling on CPU (issue 16): 4 students, K = 1, 2, 4 teacher
  # processes, one core each, the demo pair; the README's table comes from these lines.
  for k in 1 2 4; do
    run_step "bench_e2e_pool_k$k" "$BUILD/bin/bench_e2e" --jobs pool --pool-students 4 --pool-teachers $k --rounds 3
  done
fi

if want test; then
  # -j4: the multi-process tests measure detection times; 16 cores leave room for 4 at once.
  run_step ctest ctest --test-dir "$BUILD" --output-on-failure --timeout 600 -j 4
  # Which gtest cases skipped (a CUDA test that skips on a GPU machine is a failure of this check).
  grep -E "tests passed|\[  SKIPPED \]|\*\*\*" "$OUT/ctest.log" | sort | uniq -c > "$OUT/ctest-summary.txt" || true
  run_step pytest python3 -m pytest -q -rs tests/python
fi
# A copy beside the results: a device tool brings back OUT_DIR, not the tree.
cp "$LEDGER" "$OUT/" 2>/dev/null
echo "== results: $RESULTS (and $LEDGER, copied into $OUT)"
exit $FAILED
