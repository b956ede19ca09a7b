#!/usr/bin/env python3
"""Every keel command line the README and docs/ show is checked against the CLI, so that the two
cannot drift apart (a documented option that was renamed, a required option shown as optional):

  - command lines are taken from fenced code blocks (lines starting with `keel ` or `$ keel `) and
    from inline code spans that start with `keel `;
  - the (sub)command must exist, every option the line uses must be one `keel CMD --help` lists,
    and every option the help marks REQUIRED must appear outside [brackets] in a full synopsis
    (a line that gives arguments);
  - the lines that need nothing but the repository (`keel --version`, `keel topo` on this
    machine or a synthetic one, `keel plan recipes/...`) are run, and must exit as documented
    (0, or 3 for a plan that does not fit).

    $(scripts/python-env.sh) tests/integration/docs_commands_test.py KEEL
"""
import glob
import os
import re
import shlex
import subprocess
import sys

KEEL = os.path.abspath(sys.argv[1])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAILURES = []
SUBCOMMAND_GROUPS = {"bench", "tokenizer"}  # `keel bench ladder`, `keel tokenizer train`


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("  FAIL:", what)
    return cond


def documented_lines():
    """(file:line, command text) for every keel command line in README.md and docs/*.md."""
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        in_code = False
        with open(path) as f:
            for number, line in enumerate(f, 1):
                where = "%s:%d" % (os.path.relpath(path, ROOT), number)
                if line.lstrip().startswith("```"):
                    in_code = not in_code
                    continue
                if in_code:
                    text = line.strip()
                    if text.startswith("$ "):
                        text = text[2:]
                    if text.startswith("keel "):
                        found.append((where, re.sub(r"\s+#.*$", "", text)))
                    continue
                for span in re.findall(r"`(keel [^`]+)`", line):
                    found.append((where, span.replace("\\|", "|")))
    return found


HELP = {}


def help_of(words):
    """{'options': set, 'required': set, 'ok': bool} for `keel WORDS --help`."""
    key = tuple(words)
    if key not in HELP:
        p = subprocess.run([KEEL] + list(words) + ["--help"], capture_output=True, text=True)
        options, required = set(), set()
        for line in p.stdout.splitlines():
            m = re.match(r"\s+((?:-\w,)?--?[\w-]+(?:,--[\w-]+)?)(.*)", line)
            if not m:
                continue
            names = m.group(1).split(",")
            options.update(names)
            if "REQUIRED" in m.group(2):
                required.add(tuple(names))  # satisfied by any of its spellings (-n, --np)
        HELP[key] = {"ok": p.returncode == 0, "options": options, "required": required}
    return HELP[key]


def command_words(tokens):
    """The (sub)command words after `keel`: ['plan'], ['bench', 'ladder'], [] for `keel --version`."""
    if len(tokens) < 2 or tokens[1].startswith("-"):
        return []
    words = [tokens[1]]
    if tokens[1] in SUBCOMMAND_GROUPS and len(tokens) > 2 and not tokens[2].startswith("-"):
        words.append(tokens[2])
    return words


def outside_brackets(text):
    """The text with every [optional part] removed (nested ones too)."""
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\[[^\[\]]*\]", "", text)
    return text


def check_line(where, text):
    try:
        tokens = shlex.split(text)
    except ValueError:
        tokens = text.split()
    words = command_words(tokens)
    h = help_of(words)
    if not check(h["ok"], "%s: `keel %s` is not a command (%s)" % (where, " ".join(words), text)):
        return
    used = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
    for option in sorted(used):
        check(option in h["options"], "%s: `keel %s` has no option %s (%s)" % (where, " ".join(words), option, text))
    rest = tokens[1 + len(words):]
    if rest:  # a synopsis or an invocation, not a mere mention of the command
        shown = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", outside_brackets(text)))
        for names in sorted(h["required"]):
            check(any(n in shown for n in names),
                  "%s: `keel %s` requires %s, which the line leaves out or shows as optional (%s)"
                  % (where, " ".join(words), names[-1], text))


def runnable(tokens):
    """Lines that need nothing outside the repository, with their allowed exit codes."""
    words = command_words(tokens)
    if tokens[1:] == ["--version"]:
        return (0,)
    if words == ["topo"] and not any(t in ("--xml", "--export-xml") for t in tokens):
        return (0,)
    if words == ["plan"] and len(tokens) > 2 and tokens[2].startswith("recipes/"):
        return (0, 3)  # 3: the plan does not fit the device memory given, as the docs show it
    return None


def main():
    lines = documented_lines()
    check(len(lines) > 30, "found the documented command lines (%d)" % len(lines))
    ran = 0
    for where, text in lines:
        check_line(where, text)
        tokens = shlex.split(text)
        codes = runnable(tokens)
        if codes is None:
            continue
        p = subprocess.run([KEEL] + tokens[1:], capture_output=True, text=True, cwd=ROOT, timeout=300)
        ran += 1
        check(p.returncode in codes, "%s: `%s` exits %d, expected %s: %s" % (where, text, p.returncode, codes,
                                                                          p.stderr.strip()[-300:]))
    check(ran >= 5, "ran the self-contained documented commands (%d)" % ran)
    print("%d documented command lines checked, %d run" % (len(lines), ran))
    if FAILURES:
        print("%d failure(s)" % len(FAILURES))
        sys.exit(1)
    print("all documented commands agree with the CLI")


if __name__ == "__main__":
    main()
