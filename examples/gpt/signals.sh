#!/usr/bin/env bash
# The demo at equal tokens with each teacher signal (docs/demo.md, "Signals"): the demo's teacher,
# trained once, then per seed the label-only student and the distilled students (configs/demo.yaml:
# 600 steps, forward KL + CE, alpha 0.5, T 1) taught by its full logits, top-8, top-64, K = 8 and 64
# ids sampled per position (teacher.samples) and its hidden states with its head (teacher.answer:
# hidden; the C++ teacher module declares its head). No teacher cache. Held-out losses and bytes per
# token go to $OUT/signals.json (one JSON line, also printed).
#   bash examples/gpt/signals.sh     (SEEDS="1 2 3" SIGNALS="label full top8 top64 sampled8 sampled64 hidden"
#                                     OUT=logs/demo-signals DISTILL_BUILD_DIR=build; ARGS= adds --set options)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DISTILL_BUILD_DIR:-build}
out=${OUT:-logs/demo-signals}
seeds=(${SEEDS:-1 2 3})
signals=(${SIGNALS:-label full top8 top64 sampled8 sampled64 hidden})
config=configs/demo.yaml
# The teacher of seed 1 for every seed, no cache, no checkpoints: each run starts afresh.
common=(--set "trainer.teacher_weights=$out/teacher.pt" --set "teacher.weights=$out/teacher.pt"
        --set teacher.cache.mode=off --set 'checkpoint.dir=""' ${ARGS:-})
export OMP_NUM_THREADS=1
mkdir -p "$out/results"
"$build/bin/distill-gpt" train-teacher --config "$config" --set "run.log_dir=$out" "${common[@]}" | tail -n 2
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); json.dump({'val_loss': d['val_loss']}, open(sys.argv[2], 'w'))" \
  "$out/teacher/done.json" "$out/teacher.json"
for seed in "${seeds[@]}"; do
  for sig in "${signals[@]}"; do
    echo "== $sig, seed $seed"
    dir=$out/$sig-s$seed
    rm -rf "$dir"
    if [ "$sig" = label ]; then
      "$build/bin/distill-gpt" label-only --config "$config" --set "run.seed=$seed" --set "run.log_dir=$dir" "${common[@]}" | tail -n 1
      cp "$dir/label_only/done.json" "$out/results/label-s$seed.json"
      continue
    fi
    case $sig in
      full) sets=(--set teacher.vocab_size=256) ;;   # configs/demo.yaml's teacher.topk 0: float32 logits of the 256 bytes
      top8|top64) sets=(--set "teacher.topk=${sig#top}") ;;
      sampled8|sampled64) sets=(--set "teacher.samples=${sig#sampled}") ;;
      hidden) sets=(--set teacher.answer=hidden --set teacher.hidden_size=128) ;;   # = trainer.teacher_dim
      *) echo "unknown signal $sig (label, full, top8, top64, sampled8, sampled64, hidden)" >&2; exit 2 ;;
    esac
    "$build/bin/distill-run" --config "$config" --master-port 0 --set "teacher.library=$build/lib/libdistill_gpt_teacher.so" \
      --set "run.seed=$seed" --set "run.log_dir=$dir" "${common[@]}" "${sets[@]}" \
      -- "$build/bin/distill-gpt" distill 2>&1 | tee "$out/results/$sig-s$seed.log" | grep -E "slots:|job finished"
    cp "$dir/distilled/done.json" "$out/results/$sig-s$seed.json"
  done
done
python3 bench/signals_summary.py "$out" demo_signals "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
