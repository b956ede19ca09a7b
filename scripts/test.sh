#!/usr/bin/env bash
# The README's test command: install what is missing (Debian packages, the pinned Python
# environment of the references), build, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
KEEL_PYTHON=$(scripts/python-env.sh)
export KEEL_PYTHON
scripts/build.sh
cd build
# Tests run two at a time on a 2-core machine: OpenMP threads that spin while waiting would steal
# the other test's core and slow both several-fold; passive waiting sleeps instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" "$@"
