#!/usr/bin/env bash
# Builds keel with AddressSanitizer + UndefinedBehaviorSanitizer (the "asan" preset: build-asan/)
# and runs the unit and integration tests under it. Any report fails the run: UBSan halts on the
# first error, ASan aborts, LeakSanitizer checks every process at exit. Suppressions, each with its
# reason, live in tests/sanitizers/.
#
#   scripts/test-sanitizers.sh                 unit + integration tests (not the "reference" or
#                                              "no_sanitizer" labels)
#   scripts/test-sanitizers.sh -R Safetensors  extra arguments go to ctest
#
# KEEL_JOBS: build parallelism (default: nproc); KEEL_TEST_JOBS: ctest parallelism (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
jobs=${KEEL_JOBS:-$(nproc)}
start=$(date +%s)

cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
built=$(date +%s)

supp="$PWD/tests/sanitizers"
# abort_on_error: a report kills the process with SIGABRT, which no test harness mistakes for a
# clean exit (plain exit code 1 could be read as an expected keel::Error by a CLI test).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:suppressions=$supp/asan.supp"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
# hwloc's "pci" plugin (libpciaccess) leaks 2 KB per topology load, from a module hwloc unloads
# again, so LeakSanitizer can neither name nor suppress it. Without the plugin hwloc's Linux sysfs
# backend finds the same PCI devices (`keel topo` prints the same machine both ways).
export HWLOC_COMPONENTS=-pci

cd build-asan
# The reference tests compare numerics with PyTorch/npm peers and gain nothing from ASan (their keel
# side runs in the unit tests too); "no_sanitizer" marks tests too slow under ASan (the demo).
status=0
if [ $# -gt 0 ]; then
  ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" -L 'unit|integration' -LE no_sanitizer "$@" || status=$?
else
  ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" -L 'unit|integration' -LE no_sanitizer \
    -E '^integration\.data_parallel$' || status=$?
  # OpenMPI's MPI_Finalize leaks ~120 KB in ~3000 allocations per rank, most of them from MCA
  # components it has dlclosed by then (frames in "<unknown module>": no suppression can match).
  # The data-parallel test therefore runs with leak checking off; ASan's memory errors and UBSan
  # stay on.
  ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
    ctest --output-on-failure -R '^integration\.data_parallel$' || status=$?
fi
end=$(date +%s)
echo "test-sanitizers: build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s"
exit $status
