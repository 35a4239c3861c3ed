"""The pip install of a fresh clone that tests/python/test_package.py checks, started in the background.

The install compiles the whole package with the default compiler (about 500 CPU seconds on 2 cores):
started when the session collects test_package, at the lowest CPU priority (nice 19), it runs in the
cycles the other tests leave idle (their jobs wait on each other, on process start-up and on
deadlines), and test_package waits for what is left. Run alone, test_package starts it and waits.
"""

import os
import shutil
import subprocess
import sys
import tempfile

from conftest import ROOT


class PipBuild:
    """A fresh clone of ROOT and a fresh virtual environment, `pip install`ing the clone into it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="distill-pip-")
        self.clone = os.path.join(self.dir, "clone")
        self.venv = os.path.join(self.dir, "venv")
        self.python = os.path.join(self.venv, "bin", "python")
        self.log = os.path.join(self.dir, "pip.log")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISTILL_BIN_DIR")}
        env["PATH"] = f"{os.path.join(self.venv, 'bin')}:{env['PATH']}"
        env["CMAKE_BUILD_PARALLEL_LEVEL"] = os.environ.get("DISTILL_JOBS", str(os.cpu_count() or 2))
        self.env = env
        subprocess.run(["git", "clone", "-q", ROOT, self.clone], check=True)
        # The venv sees the installed torch==2.11.0 (a 2.5 GB wheel is not fetched again).
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", self.venv], check=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["nice", "-n", "19", self.python, "-m", "pip", "install", "-q",
                                          "--no-build-isolation", self.clone], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait(self, timeout=1800):
        """The install's exit status and the end of its output."""
        rc = self.proc.wait(timeout=timeout)
        with open(self.log) as f:
            return rc, f.read()[-6000:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_build = None


def can_build():
    """Why a fresh clone cannot be made here, or ""."""
    if not os.path.isdir(os.path.join(ROOT, ".git")) or shutil.which("git") is None:
        return f"{ROOT} is not a git checkout: nothing to clone"
    return ""


def start():
    """The build of this session, started on the first call."""
    global _build
    if _build is None and not can_build():
        _build = PipBuild()
    return _build


def stop():
    global _build
    if _build is not None:
        _build.close()
        _build = None
