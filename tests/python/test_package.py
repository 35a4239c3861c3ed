"""`pip install --no-build-isolation .` of a fresh clone, in a fresh virtual environment: the package
imports, its programs are on PATH, and a job runs from the installed package alone (no build tree).
Then the editable install (-e) of the same clone: its Python files are the clone's."""

import os
import subprocess
from pathlib import Path

import pytest

import pip_build
from conftest import TRAINER


def test_pip_install_of_a_fresh_clone(tmp_path, tiny_lm):
    why = pip_build.can_build()
    if why:
        pytest.skip(why)
    build = pip_build.start()  # started at collection: see tests/python/pip_build.py
    rc, log = build.wait(timeout=1800)
    assert rc == 0, log
    clone, venv, py, env = Path(build.clone), Path(build.venv), build.python, build.env
    # Imported from elsewhere: the installed package, not the clone or the build tree.
    p = subprocess.run([py, "-c", "import distill, os; print(distill.__file__); print(distill._cli.find_program('distill-run'))"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    where, run_bin = p.stdout.split()
    assert where.startswith(str(venv)), where
    for typed in ("py.typed", "_C.pyi"):  # PEP 561: type checkers read the installed package's types
        assert os.path.isfile(os.path.join(os.path.dirname(where), typed)), typed
    assert run_bin.startswith(str(venv)), run_bin
    # One version: the wheel's metadata (pyproject's, from CMakeLists.txt) is distill.__version__.
    p = subprocess.run([py, "-c", "import distill, importlib.metadata as m; print(m.version('distill'), distill.__version__)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    installed, package = p.stdout.split()
    assert installed == package, p.stdout
    # distill-run from PATH runs a job of Python students and a TorchScript teacher.
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"run: {{name: pip, steps: 2, log_dir: logs}}\nteacher: {{kind: torchscript, path: {tiny_lm}}}\n"
                   "student: {grad_acc_steps: 2}\n")
    (tmp_path / "out").mkdir()
    p = subprocess.run(["distill-run", "--config", str(cfg), "--nproc-per-node", "3", "--", py, TRAINER, "--mode",
                        "lowlevel", "--out", str(tmp_path / "out"), "--teacher", tiny_lm],
                       cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "out" / "rank1.json").exists()

    # The editable install of the same clone (it reuses the clone's build/pip objects): `distill` is
    # imported from the clone's python/distill, an edit there is seen without reinstalling, and the
    # programs are found beside the extension.
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "-e", str(clone)], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(clone / "python" / "distill" / "_cli.py", "a") as f:
        f.write("\nEDITED_IN_PLACE = 1\n")
    p = subprocess.run([py, "-c", "import distill, distill._cli as c; print(distill.__file__); print(c.EDITED_IN_PLACE); "
                        "print(c.find_program('distill-run'))"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    where, edited, run_bin = p.stdout.split()
    assert where == str(clone / "python" / "distill" / "__init__.py"), where
    assert edited == "1"
    assert run_bin.startswith(str(venv)) and os.access(run_bin, os.X_OK), run_bin
