#!/usr/bin/env python3
"""The names the public API puts directly into namespace fsdp (issue 54: at most 60, as
LibTorch keeps torch:: small and puts concepts in torch::nn, torch::optim).

  tests/lint/public_names.py [--root DIR] [--max N] [--list] [--doc FILE]

Reads the headers <fsdp/fsdp.h> includes (the whole public API; the tools' headers under
include/fsdp/tools/ are not part of it) and lists each name declared at the top level of
`namespace fsdp { ... }`: classes, structs, enums, aliases, functions (overloads count
once), variables and templates. Names in nested namespaces (fsdp::detail, fsdp::core, ...)
and names marked [[deprecated]] (aliases kept for one release) do not count. The headers
are clang-format'ed, which the parse relies on: comments and strings are blanked first,
then braces are counted. --max N: exit 1 when there are more than N. --doc FILE: exit 1
unless FILE's table of public names (docs/guide/api.md, "Every public name": a row whose
first cell names them in backticks) has a row for each name.
"""
import argparse
import os
import re
import sys


def blank(text):
    """Comments, strings and character literals blanked, newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out.append(q + " " * (min(j, n) - i - 1) + q)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def headers(root):
    """<fsdp/fsdp.h> and the fsdp headers it includes, transitively."""
    seen, todo = [], ["fsdp/fsdp.h"]
    while todo:
        h = todo.pop()
        if h in seen or h.startswith("fsdp/tools/"):
            continue
        path = os.path.join(root, "include", h)
        if not os.path.exists(path) and os.path.exists(path + ".in"):
            h += ".in"  # version.h, which CMake generates from version.h.in
            path += ".in"
        if not os.path.exists(path) or h in seen:
            continue
        seen.append(h)
        with open(path, encoding="utf-8") as f:
            todo += re.findall(r"#include <(fsdp/[^>]+)>", f.read())
    return seen


DECL = re.compile(
    r"(?:template\s*<[^;{]*?>\s*)?"
    r"(?P<deprecated>\[\[deprecated[^\]]*\]\]\s*)?"
    r"(?:(?:class|struct|enum class|enum|union)\s+(?:\[\[[^\]]*\]\]\s*)?(?P<type>[A-Za-z_]\w*)"
    r"|using\s+(?P<alias>[A-Za-z_]\w*)\s*(?:\[\[[^\]]*\]\]\s*)?="
    r"|(?P<ret>[\w:<>,*&\s]+?)\b(?P<func>[A-Za-z_]\w*)\s*\("
    r"|(?:inline\s+)?(?:constexpr|const)\s+[\w:<>]+\s+(?P<var>[A-Za-z_]\w*)\s*[=;{])",
    re.S)


def top_level_names(text):
    """(name, deprecated) for each declaration at the top level of namespace fsdp."""
    text = blank(text)
    names = []
    stack = []  # what each open brace is: "fsdp", "ns" (another namespace) or "body"
    i, stmt_start = 0, 0
    while i < len(text):
        c = text[i]
        if c == "{":
            head = text[stmt_start:i]
            m = re.search(r"namespace\s+([\w:]*)\s*$", head)
            if m:
                stack.append("fsdp" if m.group(1) == "fsdp" and not stack else "ns")
            else:
                if stack == ["fsdp"]:
                    names += decl_names(head)
                stack.append("body")
            stmt_start = i + 1
        elif c == "}":
            if stack:
                stack.pop()
            stmt_start = i + 1
        elif c == ";":
            if stack == ["fsdp"]:
                names += decl_names(text[stmt_start:i + 1])
            stmt_start = i + 1
        i += 1
    return names


def decl_names(stmt):
    stmt = re.sub(r"^\s*#.*$", "", stmt, flags=re.M).strip()
    if not stmt or stmt.startswith(("friend", "extern template", "template class")):
        return []
    if re.match(r"(class|struct)\s+\w+\s*;$", stmt):
        return []  # a forward declaration
    m = DECL.match(stmt)
    if not m:
        return []
    name = m.group("type") or m.group("alias") or m.group("func") or m.group("var")
    if name in (None, "operator") or (m.group("func") and m.group("ret").strip() in ("", "return")):
        return []
    return [(name, bool(m.group("deprecated")) or "[[deprecated" in stmt)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--max", type=int)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--doc")
    args = ap.parse_args()
    current, deprecated = {}, set()
    for h in headers(args.root):
        with open(os.path.join(args.root, "include", h), encoding="utf-8") as f:
            for name, dep in top_level_names(f.read()):
                if dep:
                    deprecated.add(name)
                else:
                    current.setdefault(name, h)
    for name in deprecated:
        current.pop(name, None) if name not in current else None
    if args.list:
        for name, h in sorted(current.items(), key=lambda kv: (kv[1], kv[0])):
            print(f"  {name:32} {h}")
    print(f"public_names: {len(current)} names directly in fsdp:: "
          f"({len(deprecated - set(current))} deprecated aside)")
    if args.max is not None and len(current) > args.max:
        print(f"public_names: {len(current)} is more than {args.max}; move what users do not need "
              "into detail or a concept's namespace (fsdp::ckpt, fsdp::pipeline, ...), keeping a "
              "[[deprecated]] alias where a user may have written it")
        return 1
    if args.doc:
        with open(args.doc, encoding="utf-8") as f:
            rows = [line.split("|")[1] for line in f if line.startswith("| `")]
        documented = {n for cell in rows for n in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)}
        missing = sorted(set(current) - documented)
        if missing:
            print(f"public_names: {args.doc} has no row for {', '.join(missing)}: add one, with a line "
                  "on what it is for")
            return 1
        print(f"public_names: {args.doc} has a row for each of the {len(current)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
