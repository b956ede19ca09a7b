# Sourced by the CLI's shell tests (tests/integration/*_test.sh KEEL): keel's absolute path in
# $keel, a scratch directory $work removed on exit, and the count of failed checks behind fail and
# finish.
set -u
keel=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}

# finish MESSAGE: exit 1 with the number of failed checks if any, else print MESSAGE.
finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures failure(s)"
    exit 1
  fi
  echo "$1"
}
