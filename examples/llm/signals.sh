#!/usr/bin/env bash
# examples/llm at equal tokens with each teacher signal: label-only (torchrun) and the students
# distilled from the teacher's top-64 (top8: top-8), its full logits, its hidden states with its
# head (teacher.answer: hidden) and K ids sampled from it per position (sampled8, sampled64:
# teacher.samples), over SEEDS (1 2 3 by default). On-policy (train.py --mode onpolicy, alpha 1):
# onpolicy_rkl, reverse KL on the teacher's top-64; onpolicy_token, the sampled-token recipe (ids
# answers of the sampled tokens, loss.kind sampled_token); each reports the teacher's
# log-likelihood of the student's samples before and after. Held-out losses and bytes per token go to
# $OUT/signals.json (one JSON line, also printed). Makes the tokenizer, tokens and teacher first
# unless $OUT has them (run.sh's REUSE). docs/llm.md, "Which signal".
#   bash examples/llm/signals.sh      (STEPS=100 TEACHER_STEPS=200 SEEDS="1 2 3" SIGNALS="label top64 full hidden";
#                                      ARGS= adds train.py options to every phase, e.g. "--vocab 1000 --max-files 30";
#                                      ARGS="--teacher-pad 256": a teacher padded past the tokenizer's 32 000 ids)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DISTILL_BUILD_DIR:-build}
steps=${STEPS:-100}
out=${OUT:-logs/llm-signals}
seeds=(${SEEDS:-1 2 3})
signals=(${SIGNALS:-label top64 full hidden})
args=(${ARGS:-})
if ! python3 -c "import distill" 2>/dev/null; then export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"; fi
run=$(command -v distill-run || echo "$build/bin/distill-run")
[ -x "$build/bin/distill-run" ] && run="$build/bin/distill-run"
export OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
ex=examples/llm/train.py
mkdir -p "$out/results"
if [ ! -f "$out/tokens.pt" ] || [ ! -f "$out/prepare.json" ]; then
  python3 $ex --mode prepare --out "$out" "${args[@]}"
fi
if [ ! -f "$out/teacher.json" ] || [ ! -d "$out/teacher" ]; then
  python3 $ex --mode teacher --out "$out" --teacher-steps "${TEACHER_STEPS:-200}" "${args[@]}"
fi
# The teacher's vocabulary and width, for the full logits' and the hidden states' response slots.
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$out/teacher/config.json")
dim=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['hidden_size'])" "$out/teacher/config.json")
# A teacher padded past the tokenizer's vocabulary (ARGS="--teacher-pad N"): the students drop its
# padded ids and renormalise (loss.vocab: truncate), in every distilled run. 200 steps leave the
# padded rows up to 0.3 % of a token's mass: loss.max_truncated_mass 1 % (docs/vocab.md).
tokens=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab'])" "$out/prepare.json")
pad=()
if [ "$vocab" -gt "$tokens" ]; then pad=(--set loss.vocab=truncate --set loss.max_truncated_mass=0.01); fi
for seed in "${seeds[@]}"; do
  for sig in "${signals[@]}"; do
    echo "== $sig, seed $seed"
    if [ "$sig" = label ]; then
      python3 -m torch.distributed.run --standalone --nproc-per-node 2 $ex --mode label --out "$out" --steps "$steps" --seed "$seed" "${args[@]}"
      cp "$out/label.json" "$out/results/label-s$seed.json"
      continue
    fi
    case $sig in
      top64) sets=() ;;   # distill.yaml's teacher.topk: 64
      # Full float32 logits: 128 000 B a token at V = 32 000, so response slots for 1 024 tokens (125 MiB each).
      full) sets=(--set teacher.topk=0 --set "teacher.vocab_size=$vocab" --set teacher.max_batch_tokens=1024) ;;
      # The teacher's final hidden states (d = 256) and its head, mapped once by both students.
      hidden) sets=(--set teacher.topk=0 --set teacher.answer=hidden --set "teacher.hidden_size=$dim") ;;
      top8) sets=(--set teacher.topk=8) ;;
      # K draws per position from the teacher (int32 ids + int16 counts): unbiased forward KL.
      sampled8|sampled64) sets=(--set teacher.topk=0 --set "teacher.samples=${sig#sampled}") ;;
      onpolicy_rkl) sets=(--set loss.kind=reverse_kl --set loss.alpha=1) ;;
      onpolicy_token) sets=(--set loss.kind=sampled_token --set loss.alpha=1 --set teacher.request_ids=1) ;;
      *) echo "unknown signal $sig (label, top64, top8, full, hidden, sampled8, sampled64, onpolicy_rkl, onpolicy_token)" >&2; exit 2 ;;
    esac
    mode=distill
    extra=()
    case $sig in onpolicy_*) mode=onpolicy ;; esac
    [ "$sig" = onpolicy_token ] && extra=(--ids token)
    rm -rf "$out/distill" "$out/distill_steps.jsonl"
    "$run" --config examples/llm/distill.yaml --master-port 0 --set "run.steps=$steps" --set "run.seed=$seed" \
      --set "run.log_dir=$out/distill" --set "checkpoint.dir=$out/distill/checkpoints" "${pad[@]}" "${sets[@]}" \
      -- python3 $ex --mode $mode --out "$out" --seed "$seed" "${args[@]}" "${extra[@]}" 2>&1 | tee "$out/results/$sig-s$seed.log" | grep -E "slots:|val_loss|job finished"
    cp "$out/$mode.json" "$out/results/$sig-s$seed.json"
  done
done
python3 bench/signals_summary.py "$out" llm_signals "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
