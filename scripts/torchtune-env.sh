#!/usr/bin/env bash
# torchtune's environment for bench/train_vs_pytorch.py's torchtune peer: a virtual environment
# holding requirements-torchtune.txt (torchtune and the old torchao it imports), layered on the
# pinned one (scripts/python-env.sh) by a .pth file, so torch, transformers and the rest are the
# references' own. Kept apart because PEFT refuses the torchao torchtune 0.6.1 needs
# (requirements-torchtune.txt says why). Prints the path of its python on stdout.
#
#   scripts/torchtune-env.sh         create or reuse, print the interpreter's path
set -euo pipefail
cd "$(dirname "$0")/.."

base_python=$(scripts/python-env.sh)
req=$PWD/requirements-torchtune.txt
hash=$(cat requirements-dev.txt "$req" | sha256sum | cut -c1-16)
root=${KEEL_PYTHON_ENV_ROOT:-$HOME/.cache/keel/python-env}
env=$root/torchtune-$hash
python=$env/bin/python

if [ -x "$python" ] && [ -f "$env/.complete" ]; then
  echo "$python"
  exit 0
fi

echo "torchtune-env: creating $env from requirements-torchtune.txt on $(dirname "$(dirname "$base_python")")" >&2
rm -rf "$env"
/usr/bin/python3 -m venv "$env"
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# After this environment's own packages: the pinned environment's (a .pth line is appended to sys.path).
echo "$base_site" >"$site/keel-pinned-environment.pth"
"$python" -m pip install -q --no-input --no-deps -r "$req" >&2
"$python" -c 'import torchtune, torchao, torch, transformers' >&2
touch "$env/.complete"
echo "$python"
