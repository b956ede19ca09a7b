#!/usr/bin/env bash
# The keel Python package as pip builds it: a wheel from this checkout (pip wheel . — the same
# CMake build, reusing build/ when scripts/build.sh or scripts/test.sh made it), installed into
# build/python-wheel/, and the package's tests (tests/python) run against that install rather than
# the build tree. `scripts/check-fresh-machine.sh` does the same with a plain `pip install .`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
python=$(scripts/python-env.sh)
rm -rf build/dist build/python-wheel
"$python" -m pip wheel -q --no-build-isolation --no-deps . -w build/dist
wheel=$(ls build/dist/keel-*.whl)
echo "test-python-package: built $wheel ($(du -h "$wheel" | cut -f1))"
"$python" -m pip install -q --no-deps --target build/python-wheel "$wheel"
cd build
PYTHONPATH=$PWD/python-wheel "$python" -c 'import keel, sys; assert "python-wheel" in keel.__file__, keel.__file__'
PYTHONPATH=$PWD/python-wheel "$python" -m pytest -q -p no:cacheprovider ../tests/python "$@"
