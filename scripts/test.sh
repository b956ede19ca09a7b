#!/usr/bin/env bash
# The README's test command: install what is missing, build, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
cd build
ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" "$@"
