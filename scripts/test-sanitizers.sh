#!/usr/bin/env bash
# Builds keel with AddressSanitizer + UndefinedBehaviorSanitizer (the "asan" preset: build-asan/)
# and runs the tests under it. Any report fails the run: UBSan halts on the first error, ASan
# aborts, LeakSanitizer checks every process at exit. Suppressions, each with its reason, live in
# tests/sanitizers/.
#
#   scripts/test-sanitizers.sh                 every test but the "no_sanitizer" label (the demo)
#   scripts/test-sanitizers.sh -R Safetensors  extra arguments go to ctest
#
# KEEL_JOBS: build parallelism (default: nproc); KEEL_TEST_JOBS: ctest parallelism (default 2).
# Only build-asan/ is configured and built: build/ (scripts/build.sh) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
KEEL_PYTHON=$(scripts/python-env.sh)
jobs=${KEEL_JOBS:-$(nproc)}
start=$(date +%s)

cmake --preset asan "-DKEEL_PYTHON=$KEEL_PYTHON" >/dev/null
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

# Two tests at a time on 2 cores: OpenMP threads sleep instead of spinning while they wait (as in
# scripts/test.sh).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

cd build-asan
# Every test but the "no_sanitizer" label (the demo: minutes in a release build, past its timeout
# under ASan), the unit tests as one process (unit.all; label one_by_one: the same tests one
# process each, for -R), and of the reference runs against torch the sample tests/CMakeLists.txt
# registers in this build (KEEL_SANITIZED_REFERENCE_SAMPLE). Times: docs/contributing.md.
labels=(-LE no_sanitizer)
[ $# -gt 0 ] || labels=(-LE "no_sanitizer|one_by_one")
# The tests whose keel processes run under mpirun (see below).
under_mpirun='^integration\.(data_parallel|zero|multihost)$|^mpi\.'
status=0
if [ $# -gt 0 ]; then
  # A selection: its tests under mpirun run apart, with leak checking off as below.
  ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" "${labels[@]}" "$@" -E "$under_mpirun" || status=$?
  selected_mpirun=$(ctest -N "${labels[@]}" "$@" | sed -n 's/^ *Test *#[0-9]*: //p' | grep -E "$under_mpirun" |
    paste -sd'|' || true)
  if [ -n "$selected_mpirun" ]; then
    ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
      ctest --output-on-failure -R "^($selected_mpirun)\$" || status=$?
  fi
else
  ctest --output-on-failure -j "${KEEL_TEST_JOBS:-2}" "${labels[@]}" \
    -E "$under_mpirun" || status=$?
  # OpenMPI's MPI_Finalize leaks ~120 KB in ~3000 allocations per rank, most of them from MCA
  # components it has dlclosed by then (frames in "<unknown module>": no suppression can match).
  # The tests run under mpirun (data parallel, ZeRO, across hosts, the communicator's collectives) therefore run with
  # leak checking off; ASan's memory errors and UBSan stay on. (integration.ladder does the same for
  # its one run under mpirun, in ladder_test.py.)
  ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
    ctest --output-on-failure -R "$under_mpirun" || status=$?
fi
end=$(date +%s)
echo "test-sanitizers: build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s"
exit $status
