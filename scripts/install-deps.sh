#!/usr/bin/env bash
# Installs the Debian packages keel needs to build, test and benchmark. Safe to rerun: it only
# calls apt-get when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libdnnl-dev            # oneDNN: GEMM primitives
  ocl-icd-opencl-dev     # Debian's oneDNN is built with its OpenCL runtime: dnnl-config.cmake
                         # calls find_package(OpenCL), and libdnnl-dev only *recommends* it
  libfmt-dev libsimdjson-dev libtomlplusplus-dev libcli11-dev libxxhash-dev
  libhwloc-dev           # hwloc: machine topology for keel topo and rank binding
  libgtest-dev
  libopenmpi-dev openmpi-bin  # data parallel over MPI
  iproute2               # ip netns: network namespaces stand in for hosts in the multi-host test
  libpcre2-dev libicu-dev  # tokenizers: pre-tokenizer regexes (PCRE2 JIT), Unicode normalization (ICU)
  zlib1g-dev libzstd-dev   # keel prepare: .jsonl.gz and .jsonl.zst input
  libopenblas0-pthread   # a real BLAS for numpy/torch peers (the reference BLAS runs 25x slower)
  python3 python3-venv  # the reference/peer environment (scripts/python-env.sh) is a venv
  python3-dev            # Python.h: the keel Python package's extension (pyproject.toml)
  ca-certificates curl git
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# Tokenizer conformance tests and bench run npm tiktoken and @huggingface/tokenizers. A node that
# already brings its own npm (e.g. a nodesource build) is kept: Debian's npm would conflict with it.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
