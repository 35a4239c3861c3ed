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
    # By file name: mypy's cache may name a file unchanged since the last run by its old folder.
    mine = [e for e in errors if os.path.basename(e.split(":")[0]) == wrong.name]
    flagged = {int(e.split(":")[1]) for e in mine}
    marked = {i for i, line in enumerate(WRONG.splitlines(), 1) if line.endswith("# E")}
    assert rc == 1 and flagged == marked, out  # every wrong line flagged, and only those
    assert [e for e in errors if e not in mine] == [], out
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


def _members(names):
    return {n for n in names if not n.startswith("__") and not n.startswith("_pybind11")}


def test_the_stub_names_everything_the_extension_has():
    import ast

    with open(os.path.join(ROOT, "python", "distill", "_C.pyi")) as f:
        tree = ast.parse(f.read())
    stub = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            stub[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            stub[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub[node.target.id] = None
    ext = distill._C
    assert set(stub) == _members(dir(ext)) | {"__version__"}, sorted(set(stub) ^ (_members(dir(ext)) | {"__version__"}))
    for name, members in stub.items():
        if members is not None:
            assert members == _members(vars(getattr(ext, name))) - {"__init__"}, name


TIMEOUT_SCRIPT = """
import sys
import distill
try:
    distill.init(["student.py", "--config", sys.argv[1]])
except TimeoutError as e:  # Python's own: distill.TimeoutError derives from it
    print("caught:", type(e).__module__, type(e).__name__, isinstance(e, distill.Error), str(e))
"""


def test_a_distill_timeout_is_caught_as_a_builtin_timeout_error(tmp_path):
    # A student whose node segment never appears: admission gives up at run.startup_timeout_s.
    assert issubclass(distill.TimeoutError, TimeoutError) and issubclass(distill.TimeoutError, distill.Error)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("teacher: {kind: self}\nrun: {startup_timeout_s: 0.5}\n")
    segment = f"distill-typing-test-{os.getpid()}"
    env = dict(os.environ, DISTILL_ROLE="student", DISTILL_LOCAL_RANK="0", DISTILL_LOCAL_WORLD_SIZE="2",
               DISTILL_NODE_RANK="0", DISTILL_NNODES="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", MASTER_PORT="1", DISTILL_SEGMENT=segment, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", TIMEOUT_SCRIPT, str(cfg)], env=env, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert f"caught: distill._C TimeoutError True [n0 r0 student] segment '{segment}' did not appear" in out, out
