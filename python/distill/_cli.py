"""distill-run and distill-teacher on PATH after `pip install --no-build-isolation .`: they run the C++ programs."""

import os
import sys
from typing import Optional

__all__ = ["find_program", "run", "teacher"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def find_program(name: str) -> Optional[str]:
    """The package's own (pip install; beside the extension in an editable install, whose Python
    files are the sources'), else this build tree's (PYTHONPATH=build/python)."""
    for d in (os.path.join(_HERE, "bin"), os.environ.get("DISTILL_BIN_DIR", "")):
        p = os.path.join(d, name)
        if d and os.access(p, os.X_OK):
            return p
    try:
        from . import _C

        for d in (os.path.join(os.path.dirname(os.path.abspath(_C.__file__)), "bin"), _C.build_bin_dir):
            p = os.path.join(d, name)
            if os.access(p, os.X_OK):
                return p
    except ImportError:
        pass
    return None


def _exec(name: str) -> None:
    path = find_program(name)
    if path is None:
        sys.exit(f"{name}: not found in {os.path.join(_HERE, 'bin')} (reinstall distill: pip install --no-build-isolation .)")
    os.execv(path, [name] + sys.argv[1:])


def run() -> None:
    """distill-run: the launcher program, with this process's arguments."""
    _exec("distill-run")


def teacher() -> None:
    """distill-teacher: the teacher program, with this process's arguments."""
    _exec("distill-teacher")
