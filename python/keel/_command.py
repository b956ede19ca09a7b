"""The keel command inside the package: `keel ...` (the console script pip installs) and the
commands the Python API runs as the CLI does (keel.generate, python -m keel.rank_table)."""
import os
import subprocess
import sys

from ._native import Error


def keel_binary():
    """The keel executable built with this package (keel/_bin/keel)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "keel")
    if not os.access(path, os.X_OK):
        raise Error("%s: the keel command is missing from the keel package (reinstall it: pip install .)" % path)
    return path


def run(args):
    """Runs `keel ARGS...`; returns its stdout. Its error message (stderr) becomes keel.Error."""
    p = subprocess.run([keel_binary()] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.returncode != 0:
        message = p.stderr.decode(errors="replace").strip()
        if message.startswith("error: "):
            message = message[len("error: "):]
        raise Error(message or "keel %s exited with status %d" % (" ".join(args), p.returncode))
    sys.stderr.write(p.stderr.decode(errors="replace"))  # the decisions keel prints, as the CLI shows them
    return p.stdout.decode(errors="replace")


def main():
    """Console script `keel`: the same program as the CLI, replacing this Python process."""
    binary = keel_binary()
    os.execv(binary, [binary] + sys.argv[1:])
