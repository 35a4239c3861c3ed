#!/usr/bin/env bash
# The demo, start to end (README, "The demo"):
#   1. the teacher, trained alone            (skipped when its weights are up to date)
#   2. the student on labels only, alone     (the baseline)
#   3. the same student, 2 data-parallel copies taught by the teacher: distill-run
#      starts them and distill-teacher, which serves the teacher of step 1
#   4. the plot, the table and summary.json  (distill-gpt report)
# Ctrl-C stops the running phase after a checkpoint; running the demo again
# resumes it and skips the finished phases.
#
#   examples/gpt/demo.sh [--build DIR] [--config FILE] [--set section.key=value]...
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DISTILL_BUILD_DIR:-build}
config=configs/demo.yaml
sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) echo "usage: $0 [--build DIR] [--config FILE] [--set section.key=value]..." >&2; exit 2 ;;
  esac
done
bin=$build/bin
gpt=("$bin/distill-gpt")
start=$(date +%s)
phase() { echo "== demo $1 ($(( $(date +%s) - start )) s)"; }

phase "1/4: teacher"
"${gpt[@]}" train-teacher --config "$config" ${sets[@]+"${sets[@]}"}
phase "2/4: student on labels only"
"${gpt[@]}" label-only --config "$config" ${sets[@]+"${sets[@]}"}
phase "3/4: students distilled from the teacher process"
# Three processes on two cores: one torch thread each (README, "Threads").
OMP_NUM_THREADS=1 "$bin/distill-run" --config "$config" \
  --set "teacher.library=$build/lib/libdistill_gpt_teacher.so" ${sets[@]+"${sets[@]}"} \
  -- "${gpt[@]}" distill
phase "4/4: report"
"${gpt[@]}" report --config "$config" ${sets[@]+"${sets[@]}"}
echo "== demo: done in $(( $(date +%s) - start )) s"
