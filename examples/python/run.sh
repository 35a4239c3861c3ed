#!/usr/bin/env bash
# examples/python, start to end: the teacher alone, the 2 label-only DDP students
# (torchrun, plain PyTorch), the same 2 students distilled (distill-run, the
# teacher served from Python); then the held-out losses side by side.
#   examples/python/run.sh            (STEPS=600 TEACHER_STEPS=600 by default)
# Uses the build tree's package (build/python) unless distill is pip-installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DISTILL_BUILD_DIR:-build}
steps=${STEPS:-600}
tsteps=${TEACHER_STEPS:-600}
out=${OUT:-logs/python}
if ! python3 -c "import distill" 2>/dev/null; then export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"; fi
run=$(command -v distill-run || echo "$build/bin/distill-run")
[ -x "$build/bin/distill-run" ] && run="$build/bin/distill-run"
export OMP_NUM_THREADS=1
ex=examples/python/train.py
mkdir -p "$out"
start=$(date +%s)
echo "== teacher, alone"
python3 $ex --mode teacher --out "$out" --teacher-steps "$tsteps"
echo "== 2 students, labels only (torchrun, DDP) ($(( $(date +%s) - start )) s)"
python3 -m torch.distributed.run --standalone --nproc-per-node 2 $ex --mode label --out "$out" --steps "$steps"
echo "== 2 students distilled (distill-run, DDP, a Python teacher) ($(( $(date +%s) - start )) s)"
rm -rf "$out/distill" "$out/distill_steps.jsonl"   # a fresh run, not a resume of the last one
"$run" --config examples/python/distill.yaml --set "run.steps=$steps" --set "run.log_dir=$out/distill" \
  --set "checkpoint.dir=$out/distill/checkpoints" -- python3 $ex --mode distill --out "$out"
echo "== done ($(( $(date +%s) - start )) s)"
python3 - "$out" <<'PY'
import json, sys
r = {k: json.load(open(f"{sys.argv[1]}/{k}.json")) for k in ("teacher", "label", "distill")}
print("held-out loss (nats/byte):  teacher %.4f   label-only student %.4f   distilled student %.4f"
      % (r["teacher"]["val_loss"], r["label"]["val_loss"], r["distill"]["val_loss"]))
PY
