"""The pip install of a fresh clone that tests/python/test_package.py checks, started in the background.

The install compiles the whole package with the default compiler (about 500 CPU seconds on 2 cores):
started at the lowest CPU priority (nice 19), it runs in the cycles the other tests leave idle (their
jobs wait on each other, on process start-up and on deadlines), and test_package waits for what is
left. `cmake/distill.sh test` starts it before ctest (`python3 tests/python/pip_build.py`, its
standard output a pipe that pytest inherits as DISTILL_PIP_BUILD_FD): it builds during the C++ tests'
waits, and the session adopts it. Otherwise the session starts it when it collects test_package;
run alone, test_package starts it and waits.
"""

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(venv):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISTILL_BIN_DIR", "DISTILL_PIP_BUILD_FD")}
    env["PATH"] = f"{os.path.join(venv, 'bin')}:{env['PATH']}"
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = os.environ.get("DISTILL_JOBS", str(os.cpu_count() or 2))
    return env


class PipBuild:
    """A fresh clone of ROOT and a fresh virtual environment, `pip install`ing the clone into it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="distill-pip-")
        self.clone = os.path.join(self.dir, "clone")
        self.venv = os.path.join(self.dir, "venv")
        self.python = os.path.join(self.venv, "bin", "python")
        self.log = os.path.join(self.dir, "pip.log")
        env = self.env = _env(self.venv)
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


class AdoptedPipBuild:
    """The build `cmake/distill.sh test` started before ctest: its builder (`python3 pip_build.py`)
    writes "dir D", "pid P" and, when pip exits, "rc N" to the pipe read here (file descriptor `fd`).
    The kernel ends the pipe when the builder exits, so a builder that died is known at once."""

    def __init__(self, fd):
        self.fd = fd
        self.lines = {}
        self.buf = b""
        self._read(time.monotonic() + 120, "dir")
        self.dir = self.lines["dir"]
        self.clone = os.path.join(self.dir, "clone")
        self.venv = os.path.join(self.dir, "venv")
        self.python = os.path.join(self.venv, "bin", "python")
        self.log = os.path.join(self.dir, "pip.log")
        self.env = _env(self.venv)

    def _read(self, deadline, key):
        while key not in self.lines:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the pip build started before ctest wrote no '{key}' line in time")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise RuntimeError(f"the pip build started before ctest ended without a '{key}' line "
                                   f"(see {self.lines.get('dir', '?')}/pip.log)")
            self.buf += chunk
            *done, self.buf = self.buf.split(b"\n")
            for line in done:
                k, _, v = line.decode().partition(" ")
                self.lines[k] = v

    def wait(self, timeout=1800):
        self._read(time.monotonic() + timeout, "rc")
        with open(self.log) as f:
            return int(self.lines["rc"]), f.read()[-6000:]

    def close(self):
        if "rc" not in self.lines and "pid" in self.lines:
            try:
                os.kill(int(self.lines["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.close(self.fd)
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
    fd = os.environ.get("DISTILL_PIP_BUILD_FD")
    if _build is None and fd:
        _build = AdoptedPipBuild(int(fd))
    if _build is None and not can_build():
        _build = PipBuild()
    return _build


def stop():
    global _build
    if _build is not None:
        _build.close()
        _build = None


if __name__ == "__main__":
    # The builder cmake/distill.sh starts before ctest: its standard output is the pipe pytest reads.
    b = PipBuild()
    print("dir", b.dir, flush=True)
    print("pid", b.proc.pid, flush=True)
    print("rc", b.proc.wait(), flush=True)
