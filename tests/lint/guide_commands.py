#!/usr/bin/env python3
"""Runs every command of the README and docs/guide/*.md, as a reader copies them.

  guide_commands.py --bin-dir BUILD/bin --root DIR [--keep DIR] [FILE.md ...]

Each page's ```sh and ```bash blocks run in order, as one bash script per block (set -e),
in a scratch folder of the page's own where build/, .venv, scripts/, examples/ and tests/
lead to this build and source tree, so the later commands of a page find what the earlier
ones wrote (a checkpoint, then its consolidation, then generation from it). A command is
one line with its backslash continuations (and a quoted string that spans lines).

Every command either runs or matches one of SKIP below, whose reason is printed: a GPU,
Slurm, a second host, or a leg of CI of its own. What runs is the command as written
except for the sizes shrink() names, printed beside it: long runs take a hundredth of
their steps (at least 2), training commands without --steps (or a DeepSpeed config that
sets them) take 2, paths under /tmp
move into the scratch folder, torchrun gets a free port, and optional [bracketed]
arguments are left out. The fixtures a page assumes exist (its input.txt, units.txt) are
written first (FIXTURES). Exit 1 naming each page, line and command that failed, with
the end of its output.
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time

# (pattern, reason): a command matching it is not run here.
SKIP = [
    (r"^\./scripts/(setup|test)\.sh\b", "the README's two commands: CI runs them on a fresh machine (.ci/run)"),
    (r"cmake --preset deb|apt-get install", "the package: CI's leg 'debian13 package' builds and installs it"),
    (r"scripts/release/deb-check\.sh", "CI's leg 'debian13 package'"),
    (r"scripts/ci/sanitize\.sh", "CI's leg 'sanitizers'"),
    (r"scripts/ci/fresh-run\.sh", "a fresh clone's setup and suite, or all of CI: by hand, up to an hour"),
    (r"scripts/ci/fuzz\.sh", "ten minutes per reader under libFuzzer: by hand, outside CI's budget"),
    (r"tests/lint/check-format\.sh", "CI's leg 'format'"),
    (r"--device cuda", "needs a GPU (the GPU check runs the CUDA paths)"),
    (r"^srun\b", "needs Slurm (its launch environment: the Launch.* tests)"),
    (r"--rdzv-endpoint", "needs a second host"),
    (r"scripts/gpu/gpu-(bundle|check)\.sh",
     "for a GPU machine; GpuCheck.RehearsedOnTheCpuWithEveryPhase rehearses the check"),
]

PROGRAM = re.compile(r"build/bin/([A-Za-z0-9_-]+)")
TRAINERS = re.compile(r"build/bin/(train_gpt|train_llama)\b")
TMP = re.compile(r"(?<![\w.])/tmp/(\w+)")
FIXTURES = {
    # The Hugging Face page's training text: any English will do.
    "input.txt": lambda root: open(os.path.join(root, "docs", "design.md"), encoding="utf-8").read(),
    # The memory page's unit sizes, one count a line.
    "units.txt": lambda root: "# root first\n210243584\n50358272\n50358272\n",
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shrink(cmd):
    """The command at a size for 2 cores, and what changed."""
    changed = []

    def scaled(flag, least):  # N >= 100 becomes N // 100 (at least `least`); smaller stay
        def sub(m):
            n = int(m.group(1))
            k = max(least, n // 100) if n >= 100 else n
            if k != n:
                changed.append(f"{flag} {n} -> {k}")
            return f"{flag} {k}"
        return sub

    out = re.sub(r"--steps (\d+)", scaled("--steps", 2), cmd)
    # --stop-at scaled as --steps is, so that it stays before the last step.
    out = re.sub(r"--stop-at (\d+)", scaled("--stop-at", 1), out)
    out2 = re.sub(r"--save-every (\d+)", "--save-every 1", out)
    if out2 != out:
        changed.append("--save-every 1")
    out = out2
    if TRAINERS.search(out) and "--steps" not in out and "--deepspeed-config" not in out:
        out = TRAINERS.sub(lambda m: m.group(0) + " --steps 2", out, count=1)
        changed.append("--steps 2 added")
    out2 = re.sub(r"\s\[[^\]]*\]", "", out)
    if out2 != out:
        changed.append("optional [arguments] left out")
    out = out2
    out2 = TMP.sub(lambda m: m.group(1), out)
    if out2 != out:
        changed.append("/tmp paths into the scratch folder")
    out = out2
    if re.search(r"\btorchrun\b", out) and "--master" not in out:
        out = re.sub(r"(\btorchrun\b)", rf"\1 --master-port {free_port()}", out, count=1)
        changed.append("a free port")
    return out, changed


def blocks(path):
    """(first line, [(line, command)]) per shell block, continuations and quotes joined."""
    out, cmds, cur, start, block = [], [], "", 0, False
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if line.startswith("```"):
                if block:
                    out.append((start, cmds))
                    cmds, cur = [], ""
                    block = False
                elif line.strip() in ("```sh", "```bash"):
                    block, start = True, n + 1
                continue
            if not block:
                continue
            if not cur:
                first = n
            cur += line + "\n"
            if line.rstrip().endswith("\\"):
                continue
            try:  # as bash reads it: comments out, quotes closed
                words = shlex.split(cur, comments=True)
            except ValueError:  # a quoted string goes on to the next line
                continue
            if words:
                cmds.append((first, cur.rstrip("\n")))
            cur = ""
    return out


def scratch(root, bin_dir, keep, page):
    base = keep or tempfile.mkdtemp(prefix="fsdp_guide_")
    d = os.path.join(base, os.path.basename(page).replace(".md", ""))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    os.symlink(os.path.dirname(os.path.abspath(bin_dir)), os.path.join(d, "build"))
    for name in (".venv", "scripts", "examples", "tests"):
        if os.path.exists(os.path.join(root, name)):
            os.symlink(os.path.join(root, name), os.path.join(d, name))
    for name, make in FIXTURES.items():
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            f.write(make(root))
    return d, base


def run_page(page, root, bin_dir, keep, timeout):
    ran, skipped, failed = 0, 0, []
    rel = os.path.relpath(page, root)
    work = base = None
    for start, cmds in blocks(page):
        script = ["set -euo pipefail"]
        for line, cmd in cmds:
            flat = re.sub(r"\\\n", " ", cmd)
            reason = next((r for p, r in SKIP if re.search(p, flat.strip())), None)
            missing = [b for b in PROGRAM.findall(flat)
                       if not os.access(os.path.join(bin_dir, b), os.X_OK)]
            if not reason and missing:
                reason = f"this build has no {missing[0]} (built without HDF5 or the examples)"
            if reason:
                print(f"[guide] {rel}:{line}: skipped ({reason}): {flat.strip()[:100]}")
                skipped += 1
                continue
            small, changed = shrink(cmd)
            note = f" [{'; '.join(changed)}]" if changed else ""
            print(f"[guide] {rel}:{line}: run{note}: {re.sub(chr(92) + chr(10), ' ', small).strip()[:160]}")
            script.append(f"echo '[guide] --- {rel}:{line}'")
            script.append(small)
            ran += 1
        if len(script) == 1:
            continue
        if work is None:
            work, base = scratch(root, bin_dir, keep, page)
        t0 = time.time()
        p = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, capture_output=True,
                           text=True, errors="replace", timeout=timeout)
        out = p.stdout + p.stderr
        if p.returncode != 0:
            at = re.findall(r"\[guide\] --- (\S+)", p.stdout)
            failed.append(f"{at[-1] if at else f'{rel}:{start}'}: exit {p.returncode} after "
                          f"{time.time() - t0:.0f} s; the end of its output:\n    " +
                          "\n    ".join(out.strip().splitlines()[-15:]))
        else:
            print(f"[guide] {rel}: block at line {start} passed in {time.time() - t0:.1f} s")
    if base and not keep:
        shutil.rmtree(base, ignore_errors=True)
    return ran, skipped, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    ap.add_argument("--keep", help="leave each page's scratch folder under this folder")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per block")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    files = a.files or [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "guide", "*.md")))
    ran = skipped = 0
    failed = []
    for page in files:
        r, s, f = run_page(os.path.abspath(page), root, a.bin_dir, a.keep, a.timeout)
        ran, skipped, failed = ran + r, skipped + s, failed + f
    for f in failed:
        print(f"[guide] FAILED: {f}", file=sys.stderr)
    print(f"[guide] {ran} commands run, {skipped} skipped with their reasons, {len(failed)} failed"
          f" ({len(files)} pages)")
    return 1 if failed or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
