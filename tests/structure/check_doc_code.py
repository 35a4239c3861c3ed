#!/usr/bin/env python3
"""Every C++ block of README.md and docs/*.md compiles against the installed headers, as a user's
program would (issue 39 item 4: docs/cpp.md's teacher example used an undefined `teacherModel`),
and docs/cpp.md's "Installed headers" table names every header `cmake --install` installs.

How: `cmake --install BUILD --prefix TMP` (what a user gets), then an outside CMake project that
finds it with find_package(distill) and compiles the blocks (compile only: nothing is linked or
run). A block is a ```cpp (or ```c++) fence. Two kinds:

- a program (it has an #include line or a `main(`): its lines as they are, its #include lines
  first in the one translation unit of all blocks, then the stand-ins below (a program may use the reader's own model
  and data types: Net, Batch, data), the rest inside a namespace of its own;
- a fragment (anything else: statements of a trainer's main()): wrapped in
  `int fragment(int argc, char** argv) { ... return 0; }`, in a namespace of its own, in that
  translation unit, which includes <distill/distill.h> and <torch/torch.h> and
  declares the names the docs leave to the reader (below: STANDINS and FRAGMENT_NAMES). A
  fragment's own declarations hide them.

Each block is compiled under a #line directive, so an error names the markdown file and line.

Usage: check_doc_code.py --root SOURCE_DIR --build BUILD_DIR
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

FENCE_OPEN = re.compile(r"^\s*```(cpp|c\+\+|C\+\+)\s*$")
FENCE = re.compile(r"^\s*```")
HEADER = re.compile(r"`(distill/[\w/]+\.h)`")

# The reader's own types, which a doc block uses without defining: declared, never defined
# (nothing is linked).
STANDINS = """
struct Net : torch::nn::Module {  // the reader's student model
  at::Tensor forward(const at::Tensor& ids);
};
struct TeacherNet : torch::nn::Module {  // the reader's teacher model
  at::Tensor forward(const at::Tensor& ids);
};
struct Batch {  // one micro-batch of the reader's data
  at::Tensor ids, labels;
};
struct Batches {  // the reader's data, this student's shard, in order
  bool more();
  Batch next();
};
extern Batches batches, data;
"""

# What the fragments use from the trainer around them.
FRAGMENT_NAMES = """
extern distill::Config cfg;                 // s.config
extern std::shared_ptr<Net> model;
extern torch::optim::AdamW opt;
extern std::string teacherFingerprint;      // e.g. distill::fileFingerprint(teacher weights)
extern int64_t steps;                       // run.steps
extern int G;                               // student.grad_acc_steps
extern std::vector<at::Tensor> params;      // model->parameters()
extern distill::StudentGroup& group;        // s.student->group()
Batch batch(int64_t step);                  // this student's batch of a step
at::Tensor loss(int acc);                   // the loss of micro-batch acc
"""


def blocks(root):
    """(path relative to root, first line number, text) of every C++ block."""
    paths = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    for path in paths:
        rel = os.path.relpath(path, root)
        lines = open(path, encoding="utf-8").read().splitlines()
        i = 0
        while i < len(lines):
            if FENCE_OPEN.match(lines[i]):
                j = i + 1
                while j < len(lines) and not FENCE.match(lines[j]):
                    j += 1
                yield rel, i + 2, "\n".join(lines[i + 1 : j])
                i = j
            i += 1


def is_program(text):
    return any(line.startswith("#include") for line in text.splitlines()) or re.search(r"\bmain\s*\(", text)


def program_unit(root, rel, line, text, n):
    includes, body = [], []
    for k, l in enumerate(text.splitlines()):
        (includes if l.startswith("#include") else body).append((k, l))
    out = [l for _, l in includes]
    out += [f"namespace doc_block_{n} {{", STANDINS]
    first = body[0][0] if body else 0
    out.append(f'#line {line + first} "{os.path.join(root, rel)}"')
    out += [l for _, l in body]
    out.append(f"}}  // namespace doc_block_{n}")
    return "\n".join(out) + "\n"


def fragment_unit(root, fragments):
    out = ["#include <distill/distill.h>", "#include <torch/torch.h>", "", "namespace doc_fragments {", STANDINS,
           FRAGMENT_NAMES]
    for n, (rel, line, text) in enumerate(fragments):
        out += [f"namespace fragment_{n} {{", "[[maybe_unused]] int fragment(int argc, char** argv) {",
                f'#line {line} "{os.path.join(root, rel)}"', text, "  return 0;", "}", "}"]
    out.append("}  // namespace doc_fragments")
    return "\n".join(out) + "\n"


def torch_dir(build):
    with open(os.path.join(build, "CMakeCache.txt"), encoding="utf-8") as f:
        m = re.search(r"^Torch_DIR:[A-Z]*=(.*)$", f.read(), re.M)
    return m.group(1) if m else ""


def installed_headers(prefix):
    inc = os.path.join(prefix, "include")
    return sorted(os.path.relpath(p, inc) for p in glob.glob(os.path.join(inc, "distill", "**", "*.h"), recursive=True))


def table_headers(root):
    """The headers the "Installed headers" section of docs/cpp.md names."""
    text = open(os.path.join(root, "docs", "cpp.md"), encoding="utf-8").read()
    m = re.search(r"^## Installed headers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return set(HEADER.findall(m.group(1))) if m else set()


def run(cmd, what):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"FAIL: {what}: {' '.join(cmd)}\n{p.stdout[-6000:]}{p.stderr[-6000:]}")
    return p.returncode == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--build", required=True)
    args = ap.parse_args()
    root, build = os.path.abspath(args.root), os.path.abspath(args.build)
    found = list(blocks(root))
    programs = [(rel, line, text) for rel, line, text in found if is_program(text)]
    fragments = [(rel, line, text) for rel, line, text in found if not is_program(text)]
    work = tempfile.mkdtemp(prefix="distill-doc-code-")
    try:
        prefix = os.path.join(work, "prefix")
        if not run(["cmake", "--install", build, "--prefix", prefix], "install the build into a temporary prefix"):
            return 1
        problems = [f"docs/cpp.md, \"Installed headers\": {h} is installed but not in the table"
                    for h in installed_headers(prefix) if h not in table_headers(root)]
        src = os.path.join(work, "project")
        os.makedirs(src)
        # One translation unit: torch's headers are parsed once, not once per block (each block keeps
        # its namespace and its #line, so its errors still name its file and line).
        units = [program_unit(root, rel, line, text, n) for n, (rel, line, text) in enumerate(programs)]
        if fragments:
            units.append(fragment_unit(root, fragments))
        includes, bodies = [], []
        for unit in units:
            body = []
            for l in unit.splitlines():
                if not l.startswith("#include"):
                    body.append(l)
                elif l not in includes:
                    includes.append(l)
            bodies.append("\n".join(body))
        with open(os.path.join(src, "doc_code.cpp"), "w") as f:
            f.write("\n".join(includes) + "\n" + "\n".join(bodies) + "\n")
        sources = ["doc_code.cpp"]
        with open(os.path.join(src, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.22)\nproject(distill_doc_code CXX)\n"
                    "set(CMAKE_CXX_STANDARD 17)\nfind_package(distill REQUIRED)\n"
                    f"add_library(doc_code OBJECT {' '.join(sources)})\n"
                    "target_link_libraries(doc_code PRIVATE distill::distill)\n")
        configure = ["cmake", "-S", src, "-B", os.path.join(work, "build"), "-G", "Ninja",
                     f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE="]
        if torch_dir(build):
            configure.append(f"-DTorch_DIR={torch_dir(build)}")
        ok = run(configure, "configure a project that finds the installed distill") and run(
            ["cmake", "--build", os.path.join(work, "build"), "-j", os.environ.get("DISTILL_JOBS", str(os.cpu_count() or 1)),
             "--", "-k", "0"],  # every block's errors
            "compile the docs' C++ blocks")
        if not ok:
            problems.append("the docs' C++ blocks do not compile against the installed headers (above)")
        for p in problems:
            print(p)
        print(f"check_doc_code: {len(programs)} program(s) and {len(fragments)} fragment(s) of "
              f"{len({rel for rel, _, _ in found})} file(s), {len(problems)} problem(s)")
        return 1 if problems else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
