#!/usr/bin/env bash
# llama.cpp's sources as the reference of keel's GGUF export (tests/reference/gguf_reference.py):
# its converter (convert_hf_to_gguf.py and the conversion/ package) and gguf-py, pure Python that
# runs in keel's Python environment (scripts/python-env.sh: torch, transformers, numpy,
# sentencepiece). They come from the source distribution of llama-cpp-python on PyPI, fetched with
# pip's own client and its configured index, once, and unpacked into a cache keyed by the version:
#   ${KEEL_LLAMA_CPP_ROOT:-$HOME/.cache/keel/llama-cpp}/<version>/
# Prints the path of the llama.cpp tree (vendor/llama.cpp) on stdout; everything else on stderr.
# The C++ library is not built (a full llama.cpp build is ~10 minutes of CI's 2 cores).
#   scripts/llama-cpp-sources.sh [python]   python: the interpreter whose pip downloads (default python3)
set -euo pipefail
version=0.3.36  # llama-cpp-python; change it here to follow a newer llama.cpp
python=${1:-python3}
base=${KEEL_LLAMA_CPP_ROOT:-$HOME/.cache/keel/llama-cpp}
dir=$base/$version
tree=$dir/llama_cpp_python-$version/vendor/llama.cpp

if [ -f "$dir/.complete" ] && [ -f "$tree/convert_hf_to_gguf.py" ]; then
  echo "$tree"
  exit 0
fi
echo "llama-cpp-sources: fetching llama-cpp-python $version's source distribution into $dir (once, ~75 MB)" >&2
rm -rf "$dir"
mkdir -p "$dir"
"$python" -m pip download -q --no-deps --no-binary :all: --dest "$dir" "llama-cpp-python==$version" >&2
tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
rm -f "$dir/llama_cpp_python-$version.tar.gz"
[ -f "$tree/convert_hf_to_gguf.py" ] || { echo "llama-cpp-sources: $tree/convert_hf_to_gguf.py is missing" >&2; exit 1; }
touch "$dir/.complete"
echo "$tree"
