#!/usr/bin/env python3
"""The answer tensors' names are spelled in the answer kinds table alone
(core/include/distill/core/answer_kinds.h and core/src/answer_kinds.cpp): every
other library file names them through its constants (protocol::kTopkValues, ...)
or reads them from the table (answerKinds(), Python's distill._C.answer_kinds),
so that what an answer is stays the table's to say (docs/design.md, "Answer
kinds"). Fails (exit 1, one line per spelling) when:

1. a C++ string literal of the library ("logits", "topk_values", "topk_indices",
   "logsumexp", "log_tail", "hidden", exactly) appears outside the table. Library: the
   module folders (core/, loss/, ipc/, group/, teacher/, student/, ckpt/,
   train/, launcher/, include/) and the binding's C++ (python/src/). Comments
   do not count.
2. a Python string literal of the package (python/distill/*.py) is one of
   "topk_values", "topk_indices", "logsumexp", "log_tail", "hidden". Docstrings and
   comments do not count: they document the dict keys a user passes to
   distill.loss (a public API, docs/python-api.md). "hidden" compared with
   teacher.answer (`.answer == "hidden"`) is that key's value, not a tensor.

"logits" is also an ordinary word, so it counts as an answer's name only where
it can be one. In C++ a literal "logits" is allowed as the default of a model
output's name (a line that assigns it to an `output...` variable or parameter:
options.h's teacher.output, model.h's outputName) and as a pybind argument name
(`arg("logits")`, the student's logits); "logits" and "hidden" as pybind
argument names and as the spellings of teacher.answer's values (options.h's
DISTILL_OPTION_ENUM_NAMES(TeacherAnswer, ...): config values, not tensors). In Python it is not checked: there it
names the model's output (hf.py, teacher.output) and a Hugging Face ModelOutput
attribute, and the package reads no answer tensor by name (the binding
converts answers by kind). Tests, benchmarks, examples and docs are not checked:
they build and describe answers by hand.

Usage: check_answer_names.py --root SOURCE_DIR
"""
import argparse
import io
import os
import re
import sys
import tokenize

NAMES = ("logits", "topk_values", "topk_indices", "logsumexp", "log_tail", "hidden")
TABLE = {"core/include/distill/core/answer_kinds.h", "core/src/answer_kinds.cpp"}
CPP_FOLDERS = ("core", "loss", "ipc", "group", "teacher", "student", "ckpt", "train", "launcher", "include",
               "python/src")
CPP_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
# A string literal or a comment, in order: only the literals count.
CPP_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)
# Where "logits" names a model output or an argument, not an answer tensor (see above).
LOGITS_ALLOWED = re.compile(r'\boutput\w*\s*=\s*"logits"|\barg\("logits"\)', re.IGNORECASE)
# Where "logits" or "hidden" names an argument or a teacher.answer value (see above).
WORD_ALLOWED = re.compile(r'\barg\("(logits|hidden)"\)|DISTILL_OPTION_ENUM_NAMES\(TeacherAnswer,')
# Where a Python "hidden" is teacher.answer's value (see above).
PY_ANSWER_VALUE = re.compile(r'\.answer\s*[!=]=\s*["\']hidden["\']')


def cpp_problems(root):
    problems = []
    for folder in CPP_FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if not name.endswith(CPP_SUFFIXES):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if rel in TABLE:
                    continue
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                lines = text.splitlines()
                for m in CPP_TOKEN.finditer(text):
                    token = m.group(0)
                    if not token.startswith('"') or token[1:-1] not in NAMES:
                        continue
                    n = text.count("\n", 0, m.start()) + 1
                    if token == '"logits"' and LOGITS_ALLOWED.search(lines[n - 1]):
                        continue
                    if token in ('"logits"', '"hidden"') and WORD_ALLOWED.search(lines[n - 1]):
                        continue
                    problems.append(f"{rel}:{n}: spells the answer tensor name {token}; use its constant "
                                    f"(protocol::k..., core/answer_kinds.h) or the kinds table")
    return problems


def python_problems(root):
    problems = []
    package = os.path.join(root, "python", "distill")
    for name in sorted(os.listdir(package)) if os.path.isdir(package) else []:
        if not name.endswith(".py"):
            continue
        rel = os.path.join("python", "distill", name)
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            source = f.read()
        previous = None
        lines = source.splitlines()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            # A string statement on its own (after an indent, a newline or at the start) is a docstring.
            docstring = tok.type == tokenize.STRING and previous in (None, tokenize.INDENT, tokenize.NEWLINE,
                                                                    tokenize.DEDENT)
            if tok.type == tokenize.STRING and not docstring:
                value = tok.string.strip("rbuRBU").strip("'\"")
                if value in NAMES and value != "logits" and not (
                        value == "hidden" and PY_ANSWER_VALUE.search(lines[tok.start[0] - 1])):
                    problems.append(f"{rel}:{tok.start[0]}: spells the answer tensor name '{value}'; read it "
                                    f"from distill._C.answer_kinds")
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                previous = tok.type
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    root = parser.parse_args().root
    problems = cpp_problems(root) + python_problems(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} spelling(s) of answer tensor names outside the answer kinds table")
        return 1
    print("answer tensor names: spelled in the answer kinds table only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
