#!/usr/bin/env bash
# examples/llm, start to end: the BPE tokenizer and the token streams; the Llama teacher alone;
# the 2 label-only DDP students (torchrun, plain PyTorch); the same 2 students distilled
# (distill-run, the Hugging Face teacher served by distill.serve); then the held-out losses,
# the wall times and distill-run's balance verdict, written to $OUT/llm.json.
#   bash examples/llm/run.sh          (STEPS=100 TEACHER_STEPS=200 by default; ARGS= adds train.py options)
# ONPOLICY=1: then the same 2 students taught on their own samples (train.py --mode onpolicy, loss.kind
# reverse_kl, alpha 1; ONPOLICY_ARGS= adds train.py options, e.g. "--lam 0.5"; docs/onpolicy.md).
# SETS= adds distill-run --set options to both distilled runs (e.g. "--set teacher.device=cuda").
# REUSE=1: keep $OUT's tokenizer, token streams and teacher (from an earlier run) instead of making them.
# Uses the build tree's package (build/python) unless distill is pip-installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DISTILL_BUILD_DIR:-build}
steps=${STEPS:-100}
tsteps=${TEACHER_STEPS:-200}
out=${OUT:-logs/llm}
args=(${ARGS:-})
if ! python3 -c "import distill" 2>/dev/null; then export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"; fi
run=$(command -v distill-run || echo "$build/bin/distill-run")
[ -x "$build/bin/distill-run" ] && run="$build/bin/distill-run"
python3 -c "import transformers, tokenizers" 2>/dev/null ||
  { echo "examples/llm needs transformers and tokenizers: pip install transformers tokenizers (or pip install --no-build-isolation '.[hf]')" >&2; exit 2; }
export OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
ex=examples/llm/train.py
mkdir -p "$out"
phase() { echo $(( $(date +%s) - t0 )); }
start=$(date +%s)
onpolicy=${ONPOLICY:-0}
opargs=(${ONPOLICY_ARGS:-})
sets=(${SETS:-})
prep=0 teach=0
if [ "${REUSE:-0}" = 1 ] && [ -f "$out/tokens.pt" ] && [ -f "$out/teacher.json" ] && [ -d "$out/teacher" ]; then
  echo "== reusing $out's tokenizer, tokens and teacher"
else
  echo "== tokenizer and tokens"
  t0=$(date +%s); python3 $ex --mode prepare --out "$out" "${args[@]}"; prep=$(phase)
  echo "== teacher, alone ($(( $(date +%s) - start )) s)"
  t0=$(date +%s); python3 $ex --mode teacher --out "$out" --teacher-steps "$tsteps" "${args[@]}"; teach=$(phase)
fi
echo "== 2 students, labels only (torchrun, DDP) ($(( $(date +%s) - start )) s)"
t0=$(date +%s)
python3 -m torch.distributed.run --standalone --nproc-per-node 2 $ex --mode label --out "$out" --steps "$steps" "${args[@]}"
label=$(phase)
echo "== 2 students distilled (distill-run, DDP, the Hugging Face teacher) ($(( $(date +%s) - start )) s)"
rm -rf "$out/distill" "$out/distill_steps.jsonl"   # a fresh run, not a resume of the last one
t0=$(date +%s)
"$run" --config examples/llm/distill.yaml --master-port 0 --set "run.steps=$steps" --set "run.log_dir=$out/distill" \
  --set "checkpoint.dir=$out/distill/checkpoints" "${sets[@]}" -- python3 $ex --mode distill --out "$out" "${args[@]}" 2>&1 |
  tee "$out/distill-run.log"
dist=$(phase)
onp=0
rm -f "$out/onpolicy.json"
if [ "$onpolicy" = 1 ]; then
  echo "== 2 students distilled on their own samples (distill-run, reverse KL) ($(( $(date +%s) - start )) s)"
  rm -rf "$out/onpolicy"
  t0=$(date +%s)
  "$run" --config examples/llm/distill.yaml --master-port 0 --set "run.steps=$steps" --set "run.log_dir=$out/onpolicy" \
    --set "checkpoint.dir=$out/onpolicy/checkpoints" --set loss.kind=reverse_kl --set loss.alpha=1 "${sets[@]}" \
    -- python3 $ex --mode onpolicy --out "$out" "${args[@]}" "${opargs[@]}" 2>&1 | tee "$out/onpolicy-run.log"
  onp=$(phase)
fi
echo "== done ($(( $(date +%s) - start )) s)"
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc alone answers OMP_NUM_THREADS (1)
python3 - "$out" "$prep" "$teach" "$label" "$dist" "$onp" "$cores" "$(uptime | sed 's/.*load average: //')" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'PY'
import json, os, re, sys
out, prep, teach, label, dist, onp, cores, load, commit = sys.argv[1:]
r = {k: json.load(open(f"{out}/{k}.json")) for k in ("prepare", "teacher", "label", "distill")}
log = open(f"{out}/distill-run.log", errors="replace").read()
m = re.findall(r"balance: (.*)", log)
verdict = m[-1].strip() if m else "(no balance verdict in distill-run's output)"
res = {"bench": "llm_example", "vocab": r["prepare"]["vocab"],
       "teacher_val_loss": r["teacher"]["val_loss"], "label_val_loss": r["label"]["val_loss"],
       "distill_val_loss": r["distill"]["val_loss"],
       "distill_gain_nats": r["label"]["val_loss"] - r["distill"]["val_loss"],
       "student_tokens": {"label": r["label"]["tokens"], "distill": r["distill"]["tokens"]},
       "teacher_tokens": r["teacher"]["tokens"],
       "phase_seconds": {"prepare": int(prep), "teacher": int(teach), "label": int(label), "distill": int(dist)},
       "train_seconds": {k: round(r[k]["seconds"], 1) for k in ("teacher", "label", "distill")},
       "balance": verdict, "cores": int(cores), "load_at_end": load, "commit": commit,
       "sample_teacher_ll": {k: r[k].get("sample_teacher_ll") for k in ("label", "distill")}}
if os.path.exists(f"{out}/onpolicy.json"):
    o = json.load(open(f"{out}/onpolicy.json"))
    res["onpolicy_val_loss"] = o["val_loss"]
    res["sample_teacher_ll"]["onpolicy"] = o["sample_teacher_ll"]
    res["student_tokens"]["onpolicy"] = o["tokens"]
    res["phase_seconds"]["onpolicy"] = int(onp)
    res["train_seconds"]["onpolicy"] = round(o["seconds"], 1)
    res["onpolicy"] = {k: o[k] for k in ("lam", "group", "prompt", "response", "onpolicy_batches", "dataset_batches")}
json.dump(res, open(f"{out}/llm.json", "w"), indent=1)
print(f"held-out loss (nats/token, V={res['vocab']}):  teacher {res['teacher_val_loss']:.4f}   "
      f"label-only student {res['label_val_loss']:.4f}   distilled student {res['distill_val_loss']:.4f}"
      f"   (distilled - label-only: {-res['distill_gain_nats']:+.4f})")
if "onpolicy_val_loss" in res:
    print(f"on-policy student {res['onpolicy_val_loss']:.4f}")
print("teacher log-likelihood of the students' samples (nats/token): "
      + "   ".join(f"{k} {v:.4f}" for k, v in res["sample_teacher_ll"].items() if v is not None))
print(f"balance: {verdict}")
print(json.dumps(res))
print(f"results: {out}/llm.json")
PY
