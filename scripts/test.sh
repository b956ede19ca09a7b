#!/usr/bin/env bash
# The README's test command: install what is missing (Debian packages, the pinned Python
# environment of the references), build, and run every test. Ends with each part's time (CI's
# phase table, .ci/run, shows where its minutes go).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
scripts/install-deps.sh
t1=$(date +%s)
KEEL_PYTHON=$(scripts/python-env.sh)
export KEEL_PYTHON
t2=$(date +%s)
scripts/build.sh
t3=$(date +%s)
cd build
# Tests run two at a time on a 2-core machine: OpenMP threads that spin while waiting would steal
# the other test's core and slow both several-fold; passive waiting sleeps instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
status=0
ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" "$@" || status=$?
t4=$(date +%s)
echo "test.sh: install-deps $((t1 - t0)) s, python env $((t2 - t1)) s, build $((t3 - t2)) s, tests $((t4 - t3)) s"
exit $status
