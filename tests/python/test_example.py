"""examples/python/run.sh, shortened: the teacher alone, 2 label-only DDP students under torchrun,
the same 2 distilled under distill-run with the teacher served from Python."""

import json
import math
import os
import subprocess

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
