"""One version (CHANGELOG.md): CMakeLists.txt's project(distill VERSION x.y.z) is the version
pip gives the package (pyproject.toml's dynamic version, scikit-build-core's regex provider
reading that line) and distill.__version__ (compiled in from the same line through
build_config.h's DISTILL_VERSION)."""

import os
import re
import tomllib

import pytest

import distill
from conftest import ROOT


def cmake_version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"^project\(distill VERSION ([0-9]+\.[0-9]+\.[0-9]+)[ )]", f.read(), re.M)
    assert m, "CMakeLists.txt has no project(distill VERSION x.y.z ...) line"
    return m.group(1)


def test_cmake_pyproject_and_the_package_say_one_version(monkeypatch):
    regex = pytest.importorskip("scikit_build_core.metadata.regex")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    assert "version" not in pyproject["project"], "pyproject.toml must not state a version of its own"
    assert "version" in pyproject["project"]["dynamic"]
    (entry,) = [e for e in pyproject["tool"]["dynamic-metadata"] if e.get("field") == "version"]
    assert entry["provider"] == "scikit_build_core.metadata.regex"
    assert entry["input"] == "CMakeLists.txt"
    monkeypatch.chdir(ROOT)  # the build backend reads `input` from the project's root
    settings = {k: v for k, v in entry.items() if k not in ("provider", "field")}
    from_pyproject = regex.dynamic_metadata("version", settings)
    assert from_pyproject == cmake_version() == distill.__version__ == distill._C.__version__


def test_the_programs_print_the_version_of_the_package(bin_dir):
    """Issue 39 item 4: `distill-run --version` and `distill-teacher --version` print the version of
    the library they run with, the one distill.__version__ states."""
    import subprocess

    for name in ("distill-run", "distill-teacher"):
        p = subprocess.run([os.path.join(bin_dir, name), "--version"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == f"{name} {distill.__version__}", p.stdout + p.stderr
