#!/usr/bin/env bash
# Configures and builds keel (Release, Ninja, ccache when present) into build/.
#   scripts/build.sh                   configure + build
#   scripts/build.sh --configure-only  configure only (scripts/check-fresh-machine.sh --configure-only)
# KEEL_PYTHON (set by scripts/test.sh from scripts/python-env.sh) is the reference environment's
# python for the Python tests; without it they are registered but fail saying how to get it. With
# it, the keel Python package is built too (build/python/keel, what the pytest suite imports).
# The tests and benchmarks are named ON because `pip install .` shares build/ and turns them off.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${KEEL_JOBS:-$(nproc)}
args=(-S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_BUILD_TESTS=ON -DKEEL_BUILD_BENCH=ON)
[ -z "${KEEL_PYTHON:-}" ] ||
  args+=("-DKEEL_PYTHON=$KEEL_PYTHON" -DKEEL_PYTHON_PACKAGE=ON "-DPython_EXECUTABLE=$KEEL_PYTHON")
cmake "${args[@]}" >/dev/null
[ "${1:-}" = --configure-only ] && exit 0
cmake --build build -j "$jobs"
