"""examples/python/run.sh, shortened: the teacher alone, 2 label-only DDP students under torchrun,
the same 2 distilled under distill-run with the teacher served from Python."""

import json
import math
import os
import shutil
import subprocess
import sys

from conftest import ROOT


def test_python_example_runs_its_three_phases(tmp_path, bin_dir):
    env = dict(os.environ, STEPS="12", TEACHER_STEPS="12", OUT=str(tmp_path / "out"),
               DISTILL_BUILD_DIR=os.path.dirname(bin_dir))
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "python", "run.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = {k: json.load(open(tmp_path / "out" / f"{k}.json")) for k in ("teacher", "label", "distill")}
    assert all(math.isfinite(v["val_loss"]) and v["val_loss"] < math.log(256) + 0.5 for v in r.values())
    assert r["distill"]["steps"] == 12
    assert "held-out loss (nats/byte)" in p.stdout
    assert "teacher: 24 requests" in p.stdout + p.stderr  # 2 students x 12 steps, served from Python


def _distill(bin_dir, out, steps, *extra):
    ex = os.path.join(ROOT, "examples", "python")
    cmd = [os.path.join(bin_dir, "distill-run"), "--config", os.path.join(ex, "distill.yaml"),
           "--set", f"run.steps={steps}", "--set", f"run.log_dir={out}/distill",
           "--set", f"checkpoint.dir={out}/distill/checkpoints", "--set", "checkpoint.every_steps=2",
           "--", sys.executable, os.path.join(ex, "train.py"), "--mode", "distill", "--out", str(out),
           "--teacher", "1,2,16", "--student", "1,2,16", "--context", "16", "--batch", "4", *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(out / "distill_steps.jsonl")]


def test_python_example_resumes_exactly(tmp_path, bin_dir):
    # --mode teacher makes its --out folder (a new one here) before saving teacher.pt.
    teacher = tmp_path / "new" / "folder"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "train.py"), "--mode", "teacher",
                        "--out", str(teacher), "--teacher", "1,2,16", "--context", "16", "--teacher-steps", "2",
                        "--teacher-batch", "4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = 7
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for d in (whole, parts):
        d.mkdir()
        shutil.copy(teacher / "teacher.pt", d / "teacher.pt")
    uninterrupted = _distill(bin_dir, whole, steps)
    assert [r["step"] for r in uninterrupted] == list(range(1, steps + 1))
    first = _distill(bin_dir, parts, steps, "--stop-after", "3")  # stops after step 3 (or 4), checkpointed
    stopped = first[-1]["step"]
    assert 3 <= stopped < steps, first
    resumed = _distill(bin_dir, parts, steps)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    # Bit-identical: the loader goes on from the checkpoint's step, not from its first batch.
    assert resumed == uninterrupted
    assert json.load(open(parts / "distill.json"))["val_loss"] == json.load(open(whole / "distill.json"))["val_loss"]
