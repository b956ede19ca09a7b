#!/usr/bin/env bash
# llama.cpp itself, built, as the reference that runs keel's GGUF files (tests/reference/
# gguf_llama_cpp.py): llama-cpp-python's source distribution (the same one scripts/llama-cpp-sources.sh
# unpacks for the converter) built into a wheel once and installed, with its one pure-Python
# dependency keel's Python environment lacks (diskcache), into a cache directory keyed by the
# version, with gguf-py from the same tree (which transformers' GGUF loader reads with); the tests
# put that directory on sys.path beside keel's environment.
#   ${KEEL_LLAMA_CPP_ROOT:-$HOME/.cache/keel/llama-cpp}/<version>/python/
# Prints that directory on stdout; everything else on stderr.
# Built portable (GGML_NATIVE=OFF: the cache may outlive this CPU), CPU only, without the
# multimodal library: ~8 CPU-minutes, once (CI's cold run: ~4-5 minutes on 2 cores).
#   scripts/llama-cpp-library.sh [python]   python: the interpreter that builds it (keel's environment's)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
tree=$(scripts/llama-cpp-sources.sh "$python")  # .../<version>/llama_cpp_python-<version>/vendor/llama.cpp
sdist=$(dirname "$(dirname "$tree")")
dir=$(dirname "$sdist")/python
if [ -f "$dir/.complete" ] && [ -d "$dir/llama_cpp" ]; then
  echo "$dir"
  exit 0
fi
echo "llama-cpp-library: building llama.cpp (llama-cpp-python's wheel) into $dir (once, ~8 CPU-minutes)" >&2
rm -rf "$dir" "$dir.wheel"
mkdir -p "$dir.wheel"
CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${KEEL_JOBS:-$(nproc)} \
  "$python" -m pip wheel -q --no-deps -w "$dir.wheel" "$sdist" >&2
# gguf-py from the same tree: transformers' GGUF loader needs it installed (it checks its version).
"$python" -m pip install -q --no-deps --target "$dir" "$dir.wheel"/llama_cpp_python-*.whl "diskcache==5.6.3" \
  "$tree/gguf-py" >&2
rm -rf "$dir.wheel"
touch "$dir/.complete"
echo "$dir"
