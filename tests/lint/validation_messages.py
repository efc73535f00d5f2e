#!/usr/bin/env python3
"""No validation message written twice (issue 54: the options core writes each rule's
message once; the engine, the estimator, the DeepSpeed reader and the flags call it).

  tests/lint/validation_messages.py [--root DIR] [DIR...]

Reads every .cpp and .h under the given folders (default: src, examples, checkpoint and
wrap_policies under --root) and finds the messages of errors: the string literals of a
statement that raises one (TORCH_CHECK, throw, bad(...), bad_input(...), UsageError(...)),
adjacent literals joined. Each literal of six words or more is a sentence of a message;
a sentence that two statements hold is reported with both places, and the exit status is
1. Short pieces (" is unknown; use ", an option's name) are shared on purpose and not
counted. With src among the folders it also finds a strategy's or a precision's name
spelled in src/ outside the options core (src/core/options_core.cpp), which names them once.
"""
import argparse
import os
import re
import sys

RAISES = re.compile(r"\b(TORCH_CHECK|TORCH_CHECK_VALUE|throw|bad|bad_input|UsageError|fail)\b")
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def statements(text):
    """(line, statement) for each statement that raises, comments blanked."""
    text = re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), text)
    end = -1
    for m in RAISES.finditer(text):
        if m.start() < end:
            continue  # inside the statement before (throw UsageError(...))
        # The statement: to the first ';' outside parentheses and strings.
        i, depth, in_str = m.start(), 0, False
        while i < len(text):
            c = text[i]
            if in_str:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            elif c == ";" and depth <= 0:
                break
            i += 1
        end = i
        yield text.count("\n", 0, m.start()) + 1, text[m.start():i]


def sentences(statement):
    """The message pieces of a statement: adjacent literals joined, four words or more."""
    pieces, current, last_end = [], "", None
    for m in LITERAL.finditer(statement):
        between = statement[last_end:m.start()] if last_end is not None else None
        if between is not None and between.strip() == "":
            current += m.group(1)
        else:
            if current:
                pieces.append(current)
            current = m.group(1)
        last_end = m.end()
    if current:
        pieces.append(current)
    return [p.strip() for p in pieces if len(p.split()) >= 6 and len(p.strip()) >= 30]


# The strategies' and precisions' names (src/core/options_core.cpp's tables): written in one
# file of the library (issue 54), the options core.
NAMES = {"full", "grad_op", "hybrid", "zero1", "zero2", "zero3", "kFullShard", "kShardGradOp",
         "kNoShard", "kHybridShard", "kZero1", "kZero2", "fp32", "bf16", "fp16"}
NAMES_HOME = os.path.join("src", "core", "options_core.cpp")


def names_outside_core(root, top):
    """Places in the library (src/) that spell a strategy's or a precision's name. A line
    marked "DeepSpeed's key" names a section of a DeepSpeed config (its "fp16" and "bf16"
    objects), not a precision."""
    found = []
    for dirpath, _, names in os.walk(os.path.join(root, top)):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if not name.endswith((".cpp", ".h")) or rel == NAMES_HOME:
                continue
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    code = line.split("//")[0] if "DeepSpeed's key" not in line else ""
                    for m in LITERAL.finditer(code):
                        if m.group(1) in NAMES:
                            found.append(f'{rel}:{n} "{m.group(1)}"')
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("dirs", nargs="*", default=["src", "examples", "checkpoint", "wrap_policies"])
    args = ap.parse_args()
    seen = {}
    files = 0
    for d in args.dirs:
        top = d if os.path.isabs(d) else os.path.join(args.root, d)
        for dirpath, _, names in os.walk(top):
            for name in sorted(names):
                if not name.endswith((".cpp", ".h")):
                    continue
                path = os.path.join(dirpath, name)
                files += 1
                rel = os.path.relpath(path, args.root)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for line, stmt in statements(text):
                    for s in set(sentences(stmt)):
                        seen.setdefault(s, []).append(f"{rel}:{line}")
    # Written in two files: the same rule checked in two places. (One function that raises
    # the same error from two branches is one place.)
    twice = {s: where for s, where in seen.items()
             if len({w.rsplit(":", 1)[0] for w in where}) > 1}
    for s, where in sorted(twice.items()):
        print(f'validation_messages: "{s}" is written {len(where)} times: {", ".join(where)}; '
              "write it once (the options core, src/core/options_core.cpp, for an option's rule) "
              "and call it")
    print(f"validation_messages: {files} files, {len(seen)} message sentences, "
          f"{len(twice)} written more than once")
    spelled = names_outside_core(args.root, "src") if "src" in args.dirs else []
    for place in spelled:
        print(f"validation_messages: {place} spells a strategy's or a precision's name; take it "
              f"from the options core (fsdp::core::strategy_name, fsdp::to_string, the parse "
              f"functions), {NAMES_HOME} being the one file that names them")
    return 1 if twice or spelled else 0


if __name__ == "__main__":
    sys.exit(main())
