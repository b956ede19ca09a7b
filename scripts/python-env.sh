#!/usr/bin/env bash
# The one Python environment of keel's references and peers: a virtual environment holding exactly
# requirements-dev.txt (torch 2, transformers, PEFT, bitsandbytes, tokenizers, tiktoken, ...), made
# once and reused. Prints the path of its python on stdout; everything else goes to stderr.
#
#   scripts/python-env.sh            create or reuse, print the interpreter's path
#   scripts/python-env.sh --path     print the path it has or will have, creating nothing (for a
#                                    configure step that only records it: .ci/run)
#
# The environment lives outside the checkout, keyed by the requirements file's hash, so every clone
# on the machine (and CI's fresh clone) reuses it, and a changed pin builds a new one:
#   ${KEEL_PYTHON_ENV_ROOT:-$HOME/.cache/keel/python-env}/<hash>/
# The wheels stay in pip's own cache (~4 GB: torch from PyPI brings CUDA libraries that the CPU
# build does not use but torch refuses to import without), so a rebuilt environment installs from
# disk. The system's python3 (Debian 12: 3.11) creates it; scripts/install-deps.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."

req=$PWD/requirements-dev.txt
hash=$(sha256sum "$req" | cut -c1-16)
base=${KEEL_PYTHON_ENV_ROOT:-$HOME/.cache/keel/python-env}
env=$base/$hash
python=$env/bin/python
if [ "${1:-}" = --path ]; then
  echo "$python"
  exit 0
fi

if [ -x "$python" ] && [ -f "$env/.complete" ]; then
  echo "$python"
  exit 0
fi

echo "python-env: creating $env from requirements-dev.txt (first time: a few minutes, ~4 GB of wheels)" >&2
start=$(date +%s)
mkdir -p "$base"
rm -rf "$env"
/usr/bin/python3 -m venv "$env"
# Keep pip's progress off CI logs; --require-hashes is not used (the pins name exact versions).
"$python" -m pip install -q --upgrade pip >&2
"$python" -m pip install -q --no-input -r "$req" >&2
"$python" -m pip check >&2
touch "$env/.complete"
echo "python-env: ready in $(( $(date +%s) - start )) s" >&2
# Older environments (other hashes) are left for other checkouts; remove them by hand if space is short.
echo "$python"
