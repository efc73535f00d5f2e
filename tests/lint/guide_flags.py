#!/usr/bin/env python3
"""The commands of the README and docs/guide/*.md use what exists: every flag given to one
of this build's programs (build/bin/NAME ... --flag) is one its --help lists, and every
script they name (scripts/..., tests/...) is a file of the project. A guide that kept an
old flag would otherwise fail only for the reader who copies it.

  guide_flags.py --bin-dir BUILD/bin [--root DIR] [FILE.md ...]

Reads ```sh and ```bash blocks (a line ending in a backslash continues on the next). A
program's flags run from its name to the next `--` (fsdp-run's command), `&&`, `|`, `;`
or `)`; bracketed flags ([--json]) count too. A program this build lacks (fsdp-consolidate
without HDF5) is reported and skipped. Exit 1 naming each file, command and flag at fault.
"""
import argparse
import glob
import os
import re
import subprocess
import sys

PROGRAM = re.compile(r"build/bin/([A-Za-z0-9_-]+)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"(?<![\w/.-])(?:\./)?((?:scripts|tests)/[\w./-]+\.(?:sh|py))")
END = re.compile(r"\s--\s|&&|\|\||\||;|\)")


def commands(path):
    """The command lines of a Markdown file's shell blocks, continuations joined."""
    out, cur, block = [], "", False
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if line.startswith("```"):
                block = (not block) and line.strip() in ("```sh", "```bash")
                continue
            if not block:
                continue
            code = re.sub(r"(^|\s)#.*$", "", line)  # a comment to the end of the line
            if code.rstrip().endswith("\\"):
                cur += code.rstrip()[:-1] + " "
                continue
            out.append((n, cur + code))
            cur = ""
    return out


def help_flags(bin_dir, name, cache):
    if name not in cache:
        exe = os.path.join(bin_dir, name)
        if not os.access(exe, os.X_OK):
            cache[name] = None
        else:
            p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
            cache[name] = set(FLAG.findall(p.stdout + p.stderr)) | {"--help"}
    return cache[name]


def check(files, bin_dir, root):
    problems, skipped, cache, checked = [], set(), {}, 0
    for path in files:
        rel = os.path.relpath(path, root)
        for n, cmd in commands(path):
            for m in SCRIPT.finditer(cmd):
                script = m.group(1)
                if not os.path.exists(os.path.join(root, script)):
                    problems.append(f"{rel}:{n}: {script} is not a file of the project")
            for m in PROGRAM.finditer(cmd):
                name = m.group(1)
                rest = cmd[m.end():]
                end = END.search(rest)
                args = rest[:end.start()] if end else rest
                known = help_flags(bin_dir, name, cache)
                if known is None:
                    skipped.add(name)
                    continue
                for flag in FLAG.findall(args):
                    checked += 1
                    if flag not in known:
                        problems.append(f"{rel}:{n}: build/bin/{name} has no {flag} "
                                        f"(its --help lists {len(known)} flags)")
    return problems, skipped, checked


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    files = args.files or [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "guide", "*.md")))
    problems, skipped, checked = check(files, args.bin_dir, root)
    for s in sorted(skipped):
        print(f"guide_flags: skipped build/bin/{s}: not in this build")
    for p in problems:
        print(f"guide_flags: {p}")
    if problems:
        print(f"guide_flags: {len(problems)} problem(s) in {len(files)} files")
        return 1
    if checked == 0:
        print("guide_flags: no flag checked: wrong --bin-dir or no commands?")
        return 1
    print(f"guide_flags: {len(files)} files, {checked} flags of this build's programs, every one "
          "listed by its --help; every script named exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
