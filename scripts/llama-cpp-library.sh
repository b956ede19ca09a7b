#!/usr/bin/env bash
# llama.cpp itself, built, as the reference that runs keel's GGUF files (tests/reference/
# gguf_llama_cpp.py): llama-cpp-python's source distribution (the same one scripts/llama-cpp-sources.sh
# unpacks for the converter) built into a wheel once and installed, with its one pure-Python
# dependency keel's Python environment lacks (diskcache), into a cache directory keyed by the
# version, with gguf-py from the same tree (which transformers' GGUF loader reads with); the tests
# put that directory on sys.path beside keel's environment.
#   ${KEEL_LLAMA_CPP_ROOT:-$HOME/.cache/keel/llama-cpp}/<version>/python/
# Prints that directory on stdout; everything else on stderr.
# Built portable (GGML_NATIVE=OFF: the cache may outlive this CPU), CPU only, Release (-O3) as the
# wheel builds it, once. Only the libraries the bindings load (libllama and ggml's) are compiled:
# the wheel's own build also compiles llama.cpp's `common` library (argument parsing, chat
# templates, JSON: a third of the CPU time) which the bindings never load, so llama.cpp is built here
# with CMake directly and the wheel is built without its library (LLAMA_BUILD=OFF: its Python files
# only), the libraries copied where the bindings look for them (llama_cpp/lib/).
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
echo "llama-cpp-library: building llama.cpp (libllama and ggml, llama-cpp-python's bindings) into $dir" \
  "(once, ~5 CPU-minutes)" >&2
rm -rf "$dir" "$dir.wheel" "$dir.build"
mkdir -p "$dir.wheel"
cmake -S "$tree" -B "$dir.build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >&2
cmake --build "$dir.build" --target llama -j "${KEEL_JOBS:-$(nproc)}" >&2
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$python" -m pip wheel -q --no-deps -w "$dir.wheel" "$sdist" >&2
# gguf-py from the same tree: transformers' GGUF loader needs it installed (it checks its version).
"$python" -m pip install -q --no-deps --target "$dir" "$dir.wheel"/llama_cpp_python-*.whl "diskcache==5.6.3" \
  "$tree/gguf-py" >&2
mkdir -p "$dir/llama_cpp/lib"
cp -P "$dir.build"/bin/lib*.so* "$dir/llama_cpp/lib/"
rm -rf "$dir.wheel" "$dir.build"
"$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp; llama_cpp.llama_backend_init()' "$dir" >&2
touch "$dir/.complete"
echo "$dir"
