#!/usr/bin/env bash
# The demo, start to end (docs/demo.md, "The demo"):
#   1. the teacher, trained alone            (skipped when its weights are up to date)
#   2. the student on labels only, alone     (the baseline)
#   3. the same student, 2 data-parallel copies taught by the teacher: distill-run
#      starts them and distill-teacher, which serves the teacher of step 1 and
#      stores every answer in its output cache (teacher.cache, mode write)
#   4. a second distilled student with another loss temperature, every teacher
#      answer read from that cache (mode read): no teacher forward at all
#   5. the plot, the table and summary.json  (distill-gpt report)
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
phase "3/5: students distilled from the teacher process"
# Three processes on two cores: one torch thread each (docs/building.md, "Threads").
OMP_NUM_THREADS=1 "$bin/distill-run" --config "$config" \
  --set "teacher.library=$build/lib/libdistill_gpt_teacher.so" ${sets[@]+"${sets[@]}"} \
  -- "${gpt[@]}" distill
phase "4/5: a second student distilled from the teacher cache"
# The cache's keys hold no temperature for full logits, so every row phase 3
# asked is a hit. No checkpoints: the phase is short and restarts when stopped.
OMP_NUM_THREADS=1 "$bin/distill-run" --config "$config" \
  --set "teacher.library=$build/lib/libdistill_gpt_teacher.so" ${sets[@]+"${sets[@]}"} \
  --set trainer.phase=distilled_cached --set teacher.cache.mode=read --set loss.temperature=2.0 \
  --set 'checkpoint.dir=""' \
  -- "${gpt[@]}" distill
phase "5/5: report"
"${gpt[@]}" report --config "$config" ${sets[@]+"${sets[@]}"}
echo "== demo: done in $(( $(date +%s) - start )) s"
