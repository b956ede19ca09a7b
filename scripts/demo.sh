#!/usr/bin/env bash
# The README's first command: install what is missing, build, and run the demo recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
mkdir -p build/demo
build/keel demo --work build/demo "$@"
