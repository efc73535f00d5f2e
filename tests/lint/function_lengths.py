#!/usr/bin/env python3
"""The longest functions of the library (src/, checkpoint/, wrap_policies/), by lines from
the line of the body's opening brace's signature to its closing brace.

  tests/lint/function_lengths.py [--top 10] [--max N] [DIR...]

--max N: exit 1, naming each, when a function is longer than N lines (issue 38: none
over 100). A function is a brace block that follows a parameter list `)` (with
qualifiers, a trailing return type or a constructor's initializer list between), outside
any other function; lambdas and local classes count toward the function around them.
Comments, strings and character literals are skipped; the preprocessor lines too.
"""
import argparse
import os
import re
import sys

ROOTS = ["src", "checkpoint", "wrap_policies"]
CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof",
           "static_assert", "defined"}


def strip(text):
    """The source with comments, strings, chars and preprocessor lines blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):
            j = i
            while True:  # continued lines
                k = text.find("\n", j)
                if k < 0:
                    k = n
                    break
                if k > 0 and text[k - 1] == "\\":
                    j = k + 1
                    continue
                break
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:k]))
            i = k
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    result, depth, start = [], 0, None  # start: (depth, line, name) of the function we are in
    for i, c in enumerate(text):
        if c == "{":
            if start is None:
                head = text[max(0, i - 600):i]
                # The text before the brace, back to the previous ; { or }.
                cut = max(head.rfind(";"), head.rfind("{"), head.rfind("}"))
                sig = head[cut + 1:]
                m = re.search(r"([~\w:<>]+)\s*\(", sig)
                flat = " ".join(sig.split())
                if m and ")" in sig and m.group(1).split("::")[-1] not in CONTROL \
                        and not re.match(r"^(namespace|class|struct|enum|union|extern)\b", flat) \
                        and "=" not in flat.split("(")[0]:
                    line = text.count("\n", 0, i - len(sig) + len(sig) - len(sig.lstrip())) + 1
                    start = (depth, line, m.group(1))
            depth += 1
        elif c == "}":
            depth -= 1
            if start is not None and depth == start[0]:
                end = text.count("\n", 0, i) + 1
                result.append((end - start[1] + 1, path, start[1], start[2]))
                start = None
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--max", type=int, default=0)
    ap.add_argument("dirs", nargs="*", default=ROOTS)
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    found = []
    for d in args.dirs:
        base = os.path.join(root, d)
        if not os.path.isdir(base):
            ap.error(f"{d} is not a directory under the project")
        for dp, _, files in os.walk(base):
            for f in sorted(files):
                if f.endswith((".cpp", ".h", ".inc")):
                    found += functions(os.path.join(dp, f))
    found.sort(key=lambda r: -r[0])
    for lines, path, line, name in found[:args.top]:
        print(f"{lines:5d}  {os.path.relpath(path, root)}:{line}  {name}")
    if args.max > 0:
        over = [r for r in found if r[0] > args.max]
        for lines, path, line, name in over:
            print(f"function_lengths: {os.path.relpath(path, root)}:{line} {name} is {lines} lines "
                  f"(more than {args.max}); split it", file=sys.stderr)
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
