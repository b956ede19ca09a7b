#!/usr/bin/env bash
# Installs the Debian packages keel needs to build, test and benchmark. Safe to rerun: it only
# calls apt-get when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libdnnl-dev            # oneDNN: GEMM primitives
  libfmt-dev libsimdjson-dev libtomlplusplus-dev libcli11-dev
  libgtest-dev
  python3-torch python3-numpy  # PyTorch reference tests and benchmarks (/usr/bin/python3)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

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
