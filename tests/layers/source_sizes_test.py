#!/usr/bin/env python3
"""No source file of src/keel over 1,000 lines and no function over 150 (docs/design.md, "Size"):
a file or function past them is doing more than one job, and the next feature would land in it.

A function is the outermost brace block whose head (the text since the last ';', '{' or '}')
has a parameter list and is not a namespace, class, struct, enum or initializer; lambdas and
nested blocks count with the function around them. Comments, string literals (raw ones too) and
character literals are blanked first, so braces inside them do not count.

    python3 tests/layers/source_sizes_test.py SRC_DIR [--max-file N] [--max-function N]

An exception needs a sentence in docs/design.md saying why the code is clearer whole, and its
path (and function head, for a function) in EXCEPTIONS below.
"""
import argparse
import os
import re
import sys

# path relative to src/keel -> why it is one piece (the same sentence as docs/design.md's); a
# function's key is "path: head", its head as printed by a failure.
EXCEPTIONS = {}

NOT_A_FUNCTION = re.compile(r"\b(namespace|struct|class|enum|union|extern)\b")


def blank(text):
    """text with comments, string and character literals blanked, newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20]) if c == "R" and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) else None
        if raw:
            end = ")" + raw.group(1) + '"'
            j = text.find(end, i + raw.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c in "\"'":
            if c == "'" and 0 < i < n - 1 and text[i - 1].isalnum() and text[i + 1].isalnum():
                out.append(c)  # a digit separator, 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(text):
    """(first line, lines, head) of every outermost function body in a source text."""
    s = blank(text)
    stack, last, found = [], 0, []
    line_starts = [0] + [k + 1 for k, ch in enumerate(s) if ch == "\n"]

    def line_of(k):
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= k:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    for k, ch in enumerate(s):
        if ch == "{":
            head = s[last:k].strip()
            is_function = (")" in head and not NOT_A_FUNCTION.search(head.split("(")[0]) and
                           not head.endswith("=") and not any(f for _, f, _ in stack))
            stack.append((k, is_function, " ".join(head.split())[-100:]))
            last = k + 1
        elif ch == "}":
            if stack:
                start, is_function, head = stack.pop()
                if is_function:
                    first = line_of(start)
                    found.append((first, line_of(k) - first + 1, head))
            last = k + 1
        elif ch == ";":
            last = k + 1
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("--max-file", type=int, default=1000)
    p.add_argument("--max-function", type=int, default=150)
    args = p.parse_args()
    failures, files, longest = [], 0, (0, "", "")
    for d, _, names in sorted(os.walk(args.src)):
        for name in sorted(names):
            if not name.endswith((".h", ".cpp")):
                continue
            path = os.path.join(d, name)
            rel = os.path.relpath(path, args.src)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            files += 1
            lines = text.count("\n") + (0 if text.endswith("\n") else 1)
            if lines > args.max_file and rel not in EXCEPTIONS:
                failures.append("%s: %d lines, over %d: split it by concern (or give it an exception: see this "
                                "test's docstring)" % (rel, lines, args.max_file))
            for first, length, head in functions(text):
                longest = max(longest, (length, "%s:%d" % (rel, first), head))
                if length > args.max_function and "%s: %s" % (rel, head) not in EXCEPTIONS:
                    failures.append("%s:%d: %s: %d lines, over %d" % (rel, first, head, length, args.max_function))
    if files == 0:
        failures.append("no .h or .cpp files under %s" % args.src)
    for f in failures:
        print("FAIL:", f)
    print("%d files; the longest function: %d lines (%s: %s)" % (files, *longest))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
