#!/usr/bin/env python3
"""The house rules of the library code, checked on every test run.

1. Include arrows: each module folder may include only the modules that the
   "Layers" table of docs/design.md allows (the table is parsed, so the test and
   the docs cannot drift apart); a relative include may not leave its module.
   The first design rule is fixed here, whatever the table says: teacher/ may
   not include group/ (the student group and its store), so teacher code cannot
   reach a collective.
2. No C++ file over 500 lines: the module folders' sources and those of
   tests/, bench/, examples/, python/ and include/ alike.
3. No include circle among the project's own files: every quote-include is
   resolved to a file of the tree (beside the includer, distill/<module>/...
   under <module>/include/, else the one file whose path ends so, nearest the
   includer); a cycle is a failure naming its files in order.
4. No library function over 80 lines, measured by lizard (pip package
   `lizard`, installed by cmake/distill.sh). Without lizard the test is
   SKIPPED (exit 77, ctest's SKIP_RETURN_CODE), never passed silently.

Usage: check_structure.py --root SOURCE_DIR
"""
import argparse
import os
import re
import subprocess
import sys

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
SKIP = 77
SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
FORBIDDEN = {"teacher": "group"}  # the first design rule (docs/design.md, "Layers")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
QUOTE_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
OTHER_FOLDERS = ("tests", "bench", "examples", "python", "include")  # C++ outside the modules


def layers(root):
    """{module: set of modules it may include} from docs/design.md's Layers table."""
    path = os.path.join(root, "docs", "design.md")
    rows = {}
    in_table = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("| folder |"):
                in_table = True
                continue
            if in_table and not line.startswith("|"):
                break
            if not in_table or line.startswith("| ---"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            module = cells[0].rstrip("/")
            allowed = {m.strip().rstrip("/") for m in cells[2].split(",")}
            rows[module] = {m for m in allowed if m}
    if not rows:
        sys.exit(f"{path}: no 'Layers' table (| folder | holds | may include |) found")
    for module, forbidden in FORBIDDEN.items():
        if module not in rows or forbidden not in rows:
            sys.exit(f"{path}: the Layers table must have rows {module}/ and {forbidden}/")
        if forbidden in rows[module]:
            sys.exit(f"{path}: the Layers table lets {module}/ include {forbidden}/; the first design rule "
                     f"forbids it (the teacher never reaches a collective)")
    return rows


def sources(root, module):
    for dirpath, _, files in os.walk(os.path.join(root, module)):
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                yield os.path.join(dirpath, name)


def include_problems(root, table):
    problems = []
    modules = set(table)
    for module, allowed in sorted(table.items()):
        for path in sources(root, module):
            rel = os.path.relpath(path, root)
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    target = m.group(1)
                    parts = target.split("/")
                    if parts[0] == "distill" and len(parts) > 2 and parts[1] in modules:
                        other = parts[1]
                    elif target.startswith("../"):
                        resolved = os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(path), target)), root)
                        other = resolved.split(os.sep)[0]
                    else:
                        continue  # system, third-party, generated (distill/build_config.h) or the module's own
                    if other != module and other not in allowed:
                        problems.append(f"{rel}:{n}: includes {target}: {module}/ may include only "
                                        f"{', '.join(sorted(allowed)) or 'nothing of distill'} (docs/design.md, Layers)")
    return problems


def all_sources(root, table):
    """Every C++ file of the project: the modules' and those of OTHER_FOLDERS."""
    for folder in sorted(table) + [f for f in OTHER_FOLDERS if os.path.isdir(os.path.join(root, f))]:
        yield from sources(root, folder)


def length_problems(root, table):
    problems = []
    for path in all_sources(root, table):
        with open(path, encoding="utf-8", errors="replace") as f:
            count = sum(1 for _ in f)
        if count > MAX_FILE_LINES:
            problems.append(f"{os.path.relpath(path, root)}: {count} lines (at most {MAX_FILE_LINES})")
    return problems


def include_graph(root, table):
    """{file: {included file: line number}} over the project's files (paths relative to root)."""
    files = sorted(os.path.relpath(p, root) for p in all_sources(root, table))
    known = set(files)
    by_tail = {}
    for f in files:
        parts = f.split(os.sep)
        for i in range(len(parts)):
            by_tail.setdefault("/".join(parts[i:]), []).append(f)

    def resolve(src, target):
        beside = os.path.normpath(os.path.join(os.path.dirname(src), target))
        if beside in known:
            return beside
        parts = target.split("/")
        if parts[0] == "distill" and len(parts) > 2 and f"{parts[1]}/include/{target}" in known:
            return f"{parts[1]}/include/{target}"
        if f"include/{target}" in known:
            return f"include/{target}"
        found = by_tail.get(target, [])
        if not found:
            return None  # a system, third-party or generated header
        return max(found, key=lambda c: (len(os.path.commonprefix([c, src])), c))

    graph = {}
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                m = QUOTE_INCLUDE.match(line)
                target = resolve(f, m.group(1)) if m else None
                if target and target != f:
                    graph.setdefault(f, {}).setdefault(target, n)
    return graph


def cycle_problems(root, table):
    """One line per include circle (a strongly connected set of files), naming a cycle through it."""
    graph = include_graph(root, table)
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # Tarjan's strongly connected components, iterative over each node's edges
        work = [(v, iter(sorted(graph.get(v, {}))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            pushed = False
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    pushed = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if pushed:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    problems = []
    for component in circles:
        members = set(component)
        path, at = [component[0]], component[0]
        while True:  # follow edges inside the component until a file repeats
            at = next(w for w in sorted(graph[at]) if w in members)
            if at in path:
                path = path[path.index(at):] + [at]
                break
            path.append(at)
        steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:]))
        problems.append(f"include circle: {steps} -> {path[-1]}")
    return problems


def function_problems(root, table):
    try:
        import lizard  # noqa: F401
    except ImportError:
        print(f"SKIPPED: function lengths: python3 cannot import lizard (pip install lizard; cmake/distill.sh "
              f"installs it)")
        return None
    dirs = [os.path.join(root, m) for m in sorted(table)]
    cmd = [sys.executable, "-m", "lizard", "-l", "cpp", "-L", str(MAX_FUNCTION_LINES), "-C", "1000", "-w"] + dirs
    out = subprocess.run(cmd, capture_output=True, text=True)
    problems = []
    for line in out.stdout.splitlines():
        m = re.match(r"^(.*?):(\d+): warning: (\S+) has .* (\d+) length", line)
        if m:
            problems.append(f"{os.path.relpath(m.group(1), root)}:{m.group(2)}: {m.group(3)} is "
                            f"{m.group(4)} lines long (at most {MAX_FUNCTION_LINES})")
        elif "warning" in line:
            problems.append(line)
    if out.returncode not in (0, 1) and not problems:
        sys.exit(f"lizard failed (exit {out.returncode}): {out.stderr.strip()}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="the source tree")
    args = ap.parse_args()
    table = layers(args.root)
    failed = False
    for title, problems in (("include arrows", include_problems(args.root, table)),
                            ("file lengths", length_problems(args.root, table)),
                            ("include circles", cycle_problems(args.root, table))):
        print(f"{title}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for p in problems:
            print(f"  {p}")
        failed = failed or bool(problems)
    functions = function_problems(args.root, table)
    if functions is not None:
        print(f"function lengths: {'ok' if not functions else f'{len(functions)} problem(s)'}")
        for p in functions:
            print(f"  {p}")
        failed = failed or bool(functions)
    if failed:
        return 1
    return SKIP if functions is None else 0


if __name__ == "__main__":
    sys.exit(main())
