"""The package's types: mypy on the package, the examples and the tests' typed use of the API
(typed_api.py), with the settings of pyproject.toml's [tool.mypy]; session.config's typed sections
against the C++ schema; distill.TimeoutError as Python's own TimeoutError."""

import os
import re
import subprocess
import sys
import textwrap
import typing

import pytest

import distill
from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def mypy(bin_dir, *paths):
    """mypy's exit status and report on `paths` (the cache in the build tree: a rerun takes seconds)."""
    pytest.importorskip("mypy")
    cache = os.path.join(os.path.dirname(bin_dir), "mypy_cache")
    p = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml"),
                        "--cache-dir", cache, "--no-color-output", "--no-error-summary", *paths],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


# Each line marked `# E` must be a mypy error: the check fails on a wrong use of the API.
WRONG = """
import distill

def wrong(session: distill.Session) -> None:
    topk: str = session.config.teacher.topk  # E
    temperature: int = session.config.loss.temperature  # E
    session.config.loss.no_such_key  # E
    session.submit("text", 1, 0)  # E
    distill.Steps(session, None, None)  # E
    distill.serve(session)  # E
    done: str = session.stop_requested()  # E
"""


def test_mypy_passes_on_the_package_the_examples_and_the_tests_use(bin_dir, tmp_path):
    wrong = tmp_path / "wrong_use.py"
    wrong.write_text(WRONG)
    rc, out = mypy(bin_dir, "python/distill", "examples/python/gpt.py", "examples/python/train.py",
                   os.path.join(HERE, "typed_api.py"), str(wrong))
    errors = [line for line in out.splitlines() if ": error:" in line]
    flagged = {int(line.split(":")[1]) for line in errors if line.startswith(str(wrong))}
    marked = {i for i, line in enumerate(WRONG.splitlines(), 1) if line.endswith("# E")}
    assert rc == 1 and flagged == marked, out  # every wrong line flagged, and only those
    assert [e for e in errors if not e.startswith(str(wrong))] == [], out
    # examples/llm apart: its train.py and examples/python's are both the module `train`.
    rc, out = mypy(bin_dir, "examples/llm/llm.py", "examples/llm/train.py")
    assert rc == 0, out


def _declared(cls, prefix):
    """The "section.key" names a Section class types."""
    out = set()
    for field, kind in typing.get_type_hints(cls).items():
        if field.startswith("_"):
            continue
        path = f"{prefix}.{field.rstrip('_')}"
        out |= _declared(kind, path) if isinstance(kind, type) and issubclass(kind, distill.config.Section) else {path}
    return out


def test_config_sections_type_every_key_of_the_schema():
    with open(os.path.join(ROOT, "core", "src", "config_schema.cpp")) as f:
        schema = {f"{s}.{k}" for s, k in re.findall(r"^\s*DISTILL_KEY\((\w+), ([\w.]+)\)", f.read(), re.M)}
    assert len(schema) > 50
    typed = set()
    for name in ("run", "teacher", "student", "transport", "loss", "checkpoint"):
        typed |= _declared(type(getattr(distill.Config({}), name)), name)
    assert typed == schema, (sorted(schema - typed), sorted(typed - schema))


def test_config_values_by_section_are_typed():
    text = {"loss.temperature": "2", "loss.kind": "jsd", "teacher.topk": "8", "teacher.cache.max_bytes": "1048576",
            "teacher.inputs": r'["input_ids", "a\"b, c", "t\tx\x01"]', "checkpoint.async": "true",
            "run.log_dir": "my logs: x", "trainer.lr": "0.1", "loss.future_key": "7"}
    cfg = distill.Config(text)
    assert cfg.loss.temperature == 2.0 and isinstance(cfg.loss.temperature, float)
    assert cfg["loss"]["temperature"] == 2.0 and cfg["loss"]["kind"] == "jsd"
    assert cfg.teacher.topk == 8 and isinstance(cfg.teacher.topk, int)
    assert cfg.teacher.cache.max_bytes == 1 << 20 and cfg["teacher"]["cache"]["max_bytes"] == 1 << 20
    assert cfg.teacher.inputs == ["input_ids", 'a"b, c', "t\tx\x01"]
    assert cfg.checkpoint.async_ is True and cfg["checkpoint"]["async"] is True
    assert cfg.trainer == {"lr": "0.1"} and cfg["trainer"] == {"lr": "0.1"}
    assert cfg["loss"]["future_key"] == "7"  # a key this package does not type yet: its text
    # As a mapping: "section.key" -> text, as session.config was before it had sections.
    assert cfg["run.log_dir"] == "my logs: x" and dict(cfg) == text and "teacher.topk" in cfg
    with pytest.raises(KeyError, match="loss.no_such_key"):
        cfg["loss"]["no_such_key"]
    with pytest.raises(AttributeError):
        cfg.loss.temperature = 3.0
