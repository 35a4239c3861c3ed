#!/usr/bin/env python3
"""Every cross-reference of the repository resolves. Fails (exit 1, one line per problem) when:

1. a relative link of README.md or docs/*.md names a file the repository does not hold, or an
   #anchor that is not a heading of its target (GitHub's heading slugs);
2. a citation `docs/NAME.md, "Heading"` or `README "Heading"` (in any tracked file: comments,
   docs, scripts) names a heading its file does not have;
3. a config key named in README.md or docs/*.md (`section.key`, section one of reference.yaml's)
   is not a key of configs/reference.yaml (config_test checks that file against the schema);
4. a tracked file cites a file the repository does not hold: a *.md name, a path under one of
   the repository's top-level folders (git-ignored outputs such as build/ and logs/ aside), or a
   "postmortem";
5. README.md or docs/*.md cites a segment layout version ("layout version (14)", "layout
   version 14") other than ipc/src/wire.h's kLayoutVersion.

Outside a git checkout the test is SKIPPED (exit 77), never passed silently.

Usage: check_xrefs.py --root SOURCE_DIR
"""
import argparse
import os
import re
import subprocess
import sys

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
# docs/errors.md, "Where errors are not thrown"  |  docs/design.md "Layers"  |  README "Launching"
DOC_CITATION = re.compile(r'\b(docs/[\w.-]+\.md|README(?:\.md)?),?\s+(?:section\s+)?"([^"\n]+)"')
MD_NAME = re.compile(r"(?<![\w/.-])([\w-]+(?:/[\w.-]+)*\.md)\b")
KEY = re.compile(r"(?<![\w./-])([a-z]+)\.([a-z_]+(?:\.[a-z_]+)?)(?![\w(-])")
FILE_SUFFIX = re.compile(r"\.(pt|h|hpp|cpp|py|yaml|yml|md|so|json|jsonl|log|txt|png|sh|mdb|toml)$")
SKIP = 77  # ctest's SKIP_RETURN_CODE: a source tree without git cannot list its files
POSTMORTEM = re.compile(r"\bpost-?mortem\b", re.IGNORECASE)


def git_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def read_text(root, path):
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None


def slug(text):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(text):
    """(line number, line) of a markdown text outside its code blocks (fence lines left out)."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield n, line


def headings(text):
    """(heading texts with backticks dropped, anchors) of a markdown text; code blocks skipped."""
    names, anchors, seen = set(), set(), {}
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        names.add(m.group(2).replace("`", ""))
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return names, anchors


def reference_keys(root):
    """section.key (and section.group.key) of configs/reference.yaml, parsed as config_test does."""
    keys, section, group = set(), "", ""
    with open(os.path.join(root, "configs", "reference.yaml"), encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.lstrip().startswith("#") or ":" not in line:
                continue
            name, _, rest = line.partition(":")
            if not line.startswith(" "):
                section, group = name, ""
                continue
            indent = len(name) - len(name.lstrip())
            value = rest.strip()
            if indent == 2 and (not value or value.startswith("#")):
                group = name.strip()
                keys.add(f"{section}.{group}")
            elif indent == 2:
                group = ""
                keys.add(f"{section}.{name.strip()}")
            else:
                keys.add(f"{section}.{group}.{name.strip()}")
    return keys


class Repo:
    def __init__(self, root):
        self.root = root
        self.files = git_files(root)
        self.file_set = set(self.files)
        self.dirs = {os.path.dirname(p) for p in self.files}
        for d in list(self.dirs):
            while d:
                d = os.path.dirname(d)
                self.dirs.add(d)
        self.basenames = {os.path.basename(p) for p in self.files}
        self.suffixes = {"/".join(p.split("/")[i:]) for p in self.files for i in range(1, p.count("/") + 1)}
        self.top = {p.split("/")[0] for p in self.files if "/" in p}
        self.docs = [p for p in self.files if p == "README.md" or re.fullmatch(r"docs/[^/]+\.md", p)]
        self._headings = {}

    def holds(self, path):
        path = os.path.normpath(path)
        return path in self.file_set or path in self.dirs

    def headings_of(self, path):
        if path not in self._headings:
            text = read_text(self.root, path) if path in self.file_set else None
            self._headings[path] = headings(text) if text is not None else None
        return self._headings[path]

    def ignored(self, paths):
        if not paths:
            return set()
        out = subprocess.run(["git", "-C", self.root, "check-ignore", "--no-index", "--stdin"],
                             input="\n".join(paths), capture_output=True, text=True).stdout
        return set(out.split())


def check_links(repo, problems):
    for doc in repo.docs:
        for n, line in prose_lines(read_text(repo.root, doc)):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                path = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                if not repo.holds(path):
                    problems.append(f"{doc}:{n}: link to {target}: {path} is not in the repository")
                elif anchor and path.endswith(".md"):
                    found = repo.headings_of(path)
                    if found is not None and anchor not in found[1]:
                        problems.append(f"{doc}:{n}: link to {target}: {path} has no heading #{anchor}")


def check_citations(repo, path, text, problems):
    for m in DOC_CITATION.finditer(text):
        target = m.group(1)
        target = "README.md" if target.startswith("README") else target
        line = text.count("\n", 0, m.start()) + 1
        found = repo.headings_of(target)
        if found is None:
            problems.append(f"{path}:{line}: cites {target}, which the repository does not hold")
        elif m.group(2).replace("`", "") not in found[0]:
            problems.append(f'{path}:{line}: cites {target}, "{m.group(2)}": no such heading')


def check_keys(repo, keys, problems):
    sections = {k.split(".")[0] for k in keys} - {"trainer"}
    for doc in repo.docs:
        # Code blocks left out: examples of output, such as a misspelt key's error.
        for n, line in prose_lines(read_text(repo.root, doc)):
            for m in KEY.finditer(line):
                key = f"{m.group(1)}.{m.group(2)}"
                if m.group(1) in sections and not FILE_SUFFIX.search(key) and key not in keys:
                    problems.append(f"{doc}:{n}: config key {key} is not in configs/reference.yaml")


def check_cited_files(repo, path, text, problems, cited):
    for m in MD_NAME.finditer(text):
        name = m.group(1)
        here = os.path.normpath(os.path.join(os.path.dirname(path), name))
        if not (repo.holds(name) or repo.holds(here) or os.path.basename(name) in repo.basenames):
            cited.append((path, text.count("\n", 0, m.start()) + 1, name))
    tops = "|".join(re.escape(t) for t in sorted(repo.top))
    for m in re.finditer(rf"(?<![\w./-])((?:{tops})/[\w./+-]*[\w+])", text):
        name = m.group(1)
        after = text[m.end():m.end() + 2]
        if "." not in os.path.basename(name) and not after.startswith("/"):
            continue  # a file without a suffix or a folder without its slash: "loss/kd/ce" is prose
        if repo.holds(name) or name in repo.suffixes or after.startswith(("*", ".*", "<", "{", "…")) or "..." in name:
            continue
        cited.append((path, text.count("\n", 0, m.start()) + 1, name))
    for m in POSTMORTEM.finditer(text):
        if not any("postmortem" in f.lower() for f in repo.files):
            problems.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: cites a postmortem the "
                            "repository does not hold")


LAYOUT_CITED = re.compile(r"layout version \(?(\d+)\)?")
LAYOUT_DEFINED = re.compile(r"constexpr uint32_t kLayoutVersion = (\d+);")


def check_layout_version(repo, problems):
    defined = LAYOUT_DEFINED.search(read_text(repo.root, "ipc/src/wire.h") or "")
    if not defined:
        problems.append("ipc/src/wire.h: no kLayoutVersion to compare the docs' citations with")
        return
    for doc in repo.docs:
        for n, line in enumerate((read_text(repo.root, doc) or "").splitlines(), 1):
            for m in LAYOUT_CITED.finditer(line):
                if m.group(1) != defined.group(1):
                    problems.append(f"{doc}:{n}: cites layout version {m.group(1)}; ipc/src/wire.h has "
                                    f"{defined.group(1)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    root = os.path.abspath(ap.parse_args().root)
    try:
        repo = Repo(root)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check_xrefs: SKIPPED: {root} is no git checkout (git ls-files: {e})")
        return SKIP
    problems, cited = [], []
    check_links(repo, problems)
    check_keys(repo, reference_keys(root), problems)
    check_layout_version(repo, problems)
    me = os.path.relpath(os.path.abspath(__file__), root)
    for path in repo.files:
        text = read_text(root, path)
        if text is None or path == me or path.startswith(("third_party/", ".git")):
            continue
        check_citations(repo, path, text, problems)
        check_cited_files(repo, path, text, problems, cited)
    ignored = repo.ignored([name for _, _, name in cited])
    problems += [f"{p}:{n}: cites {name}, which the repository does not hold"
                 for p, n, name in cited if name not in ignored]
    problems = list(dict.fromkeys(problems))
    for p in problems:
        print(p)
    print(f"check_xrefs: {len(repo.docs)} pages, {len(repo.files)} files, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
