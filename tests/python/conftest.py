"""Fixtures of the Python suite: the build's programs and the TorchScript teacher.

Run from the README's test command (cmake/distill.sh test), or by hand:
    PYTHONPATH=build/python DISTILL_BIN_DIR=build/bin python3 -m pytest tests/python
"""

import os
import signal
import subprocess
import sys

import pytest

# The jobs these tests start get SIGINT's default action (KeyboardInterrupt in Python) even when
# this run inherited SIGINT ignored, as a background job of a non-interactive shell does: the
# Ctrl-C tests send SIGINT to a rank and expect it to act. A handled signal is reset to its
# default in every program this process starts; an ignored one would stay ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRAINER = os.path.join(os.path.dirname(__file__), "trainer.py")


def _bin_dir():
    d = os.environ.get("DISTILL_BIN_DIR") or os.path.join(ROOT, "build", "bin")
    if not os.access(os.path.join(d, "distill-run"), os.X_OK):
        pytest.exit(f"no distill-run in {d}: build first (bash cmake/distill.sh test) or set DISTILL_BIN_DIR")
    return d


def pytest_collection_finish(session):
    # test_package's pip install of a fresh clone starts now and builds in the cycles the other
    # tests leave idle (tests/python/pip_build.py).
    if any(item.nodeid.split("::")[0].endswith("test_package.py") for item in session.items):
        import pip_build

        pip_build.start()


def pytest_sessionfinish(session, exitstatus):
    import pip_build

    pip_build.stop()


@pytest.fixture(scope="session")
def bin_dir():
    return _bin_dir()


@pytest.fixture(scope="session")
def tiny_lm():
    build = os.path.dirname(_bin_dir())
    path = os.path.join(build, "tests", "teacher", "tiny_lm.pt")
    if not os.path.exists(path):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "teacher", "make_teacher.py"), path], check=True)
    return path


class Job:
    """One distill-run job of tests/python/trainer.py."""

    def __init__(self, bin_dir, tmp_path, tiny_lm):
        self.bin_dir, self.dir, self.tiny_lm = bin_dir, tmp_path, tiny_lm

    def run(self, mode, yaml_text, timeout=240, students=2, options=(), env=None):
        """`options`: more distill-run options; `env`: more environment variables."""
        cfg = self.dir / "job.yaml"
        cfg.write_text(yaml_text)
        out = self.dir / "out"
        out.mkdir(exist_ok=True)
        cmd = [os.path.join(self.bin_dir, "distill-run"), "--config", str(cfg), "--nproc-per-node", str(students + 1),
               *options, "--", sys.executable, TRAINER, "--mode", mode, "--out", str(out), "--teacher", self.tiny_lm]
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        p = subprocess.run(cmd, cwd=self.dir, env=env, capture_output=True, text=True, timeout=timeout)
        self.output = p.stdout + p.stderr
        return p.returncode

    def report(self, rank):
        import json

        with open(self.dir / "out" / f"rank{rank}.json") as f:
            return json.load(f)


@pytest.fixture
def job(bin_dir, tmp_path, tiny_lm):
    return Job(bin_dir, tmp_path, tiny_lm)
