#!/usr/bin/env python3
"""distill's error types are written once: DISTILL_ERROR_TYPES in core/include/distill/core/errors.h.
The C++ classes, errorTypeName and the Python classes are generated from it; this check fails
(exit 1, one line per problem) when a hand-written list disagrees with it:

1. the names python/distill/__init__.py imports from distill._C that end in "Error" (besides
   the base, Error);
2. the types in the first table of docs/errors.md (its rows' first cells);
3. the types docs/python.md's "Errors arrive as ..." sentence names.

Usage: check_errors.py --root SOURCE_DIR
"""
import argparse
import os
import re
import sys


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def cpp_list(root):
    text = read(root, "core/include/distill/core/errors.h")
    m = re.search(r"#define DISTILL_ERROR_TYPES\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    if not m:
        sys.exit("check_errors: no DISTILL_ERROR_TYPES(X) in core/include/distill/core/errors.h")
    return re.findall(r"X\((\w+)\)", m.group(1))


def python_exports(root):
    text = read(root, "python/distill/__init__.py")
    m = re.search(r"from \._C import \(([^)]*)\)", text)
    names = re.findall(r"\b(\w+)\b,?", m.group(1)) if m else []
    return [n for n in names if n.endswith("Error") and n != "Error"]


def docs_table(root):
    names, seen_table = [], False
    for line in read(root, "docs/errors.md").splitlines():
        if line.startswith("| type |"):
            seen_table = True
            continue
        if seen_table:
            if not line.startswith("|"):
                break
            m = re.match(r"\|\s*`(\w+)`\s*\|", line)
            if m:
                names.append(m.group(1))
    return names


def python_doc(root):
    text = read(root, "docs/python.md")
    m = re.search(r"Errors arrive as (.*?)\(all", text, re.S)
    return re.findall(r"`(?:distill\.)?(\w+Error)`", m.group(1)) if m else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    root = ap.parse_args().root
    want = cpp_list(root)
    problems = []
    if len(want) < 2 or len(set(want)) != len(want):
        problems.append(f"errors.h: DISTILL_ERROR_TYPES is empty or names a type twice: {want}")
    for where, got in (("python/distill/__init__.py's imports from _C", python_exports(root)),
                       ("docs/errors.md's table", docs_table(root)),
                       ("docs/python.md's \"Errors arrive as\" sentence", python_doc(root))):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing:
            problems.append(f"{where} lacks {', '.join(missing)} (errors.h: DISTILL_ERROR_TYPES)")
        if extra:
            problems.append(f"{where} names {', '.join(extra)}, which DISTILL_ERROR_TYPES does not")
    for p in problems:
        print(p)
    if not problems:
        print(f"check_errors: {len(want)} error types, the same in errors.h, distill's exports and the docs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
