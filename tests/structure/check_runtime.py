"""Every shared object and program distill builds uses the shared C++ runtime (libstdc++.so.6),
the one torch and the Python interpreter load, and carries no copy of it: a private libstdc++
in a library crashes the first `stream << number` inside distill called from Python
(cmake/DistillToolchain.cmake says when a compiler does that).

    python3 tests/structure/check_runtime.py --build BUILD_DIR
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

# Definitions only libstdc++ itself holds (its explicit instantiations and locale machinery).
SENTINELS = ("_ZNSo9_M_insertIlEERSoT_", "_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev")


def elf_files(build: str):
    for pattern in ("lib/*.so*", "bin/*", "python/distill/*.so"):
        for path in sorted(glob.glob(os.path.join(build, pattern))):
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    if f.read(4) == b"\x7fELF":
                        yield path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    build = p.parse_args().build
    if not shutil.which("objdump") or not shutil.which("nm"):
        print("objdump or nm missing: skipped")
        return 77
    problems, checked = [], 0
    for path in elf_files(build):
        deps = subprocess.run(["objdump", "-p", path], capture_output=True, text=True).stdout
        defined = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout
        copies = [s for s in SENTINELS if s in defined.split()]
        cxx = "libstdc++" in deps or copies or "_Z" in defined
        if not cxx:
            continue
        checked += 1
        name = os.path.relpath(path, build)
        if copies:
            problems.append(f"{name} defines libstdc++'s own symbols ({', '.join(copies)}): a static copy was linked in")
        if not re.search(r"NEEDED\s+libstdc\+\+\.so", deps):
            problems.append(f"{name} does not need libstdc++.so.6")
    if checked == 0:
        print(f"no C++ shared objects or programs under {build}")
        return 1
    for line in problems:
        print("FAIL:", line)
    print(f"{checked} shared objects and programs checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
