#!/usr/bin/env bash
# Real models' chat templates for the chat-template reference test (tests/reference/
# chat_template_reference.py): the models/templates/*.jinja files that llama.cpp collects from the
# models' Hugging Face repositories, as the PyPI sdist of llama-cpp-python vendors them. Fetched
# once, checked against the pinned sha256, and only the .jinja files extracted. Prints the
# directory holding them on stdout; everything else goes to stderr.
#
#   scripts/reference-templates.sh        fetch (first time) or reuse, print the templates' directory
#
# The cache lives outside the checkout, so every clone on the machine reuses it:
#   ${KEEL_CACHE:-$HOME/.cache/keel}/reference-templates/<version>/
#       llama_cpp_python-<version>.tar.gz   the sdist (76 MB), kept: re-extraction needs no network
#       templates/*.jinja                   what this script prints
# The download goes through the reference environment's pip (scripts/python-env.sh), so pip's own
# settings apply (PIP_CERT, PIP_INDEX_URL, proxies, /etc/pip.conf). pip checks the pinned hash
# itself (--require-hashes) and the script checks it again before extracting. A sdist already in
# the cache directory with the right hash is used as it is (copy one there to work offline).
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # the sdist PyPI serves for that version
sdist_name=llama_cpp_python-$version.tar.gz
member="llama_cpp_python-$version/vendor/llama.cpp/models/templates"

cache=${KEEL_CACHE:-$HOME/.cache/keel}/reference-templates/$version
templates=$cache/templates
if [ -f "$templates/.complete" ]; then
  echo "$templates"
  exit 0
fi

mkdir -p "$cache"
sdist=$cache/$sdist_name
hash_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha256" ]; }

if ! hash_ok "$sdist"; then
  python=$(scripts/python-env.sh)
  tmp=$(mktemp -d "$cache/download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "llama-cpp-python==$version --hash=sha256:$sha256" >"$tmp/requirements.txt"
  echo "reference-templates: downloading $sdist_name (76 MB) with $python -m pip" >&2
  # --no-deps and --no-binary: the sdist alone (pip still reads its metadata, which installs the
  # build backend into an isolated environment for a moment).
  "$python" -m pip download -q --no-input --no-deps --no-binary :all: --require-hashes \
    -r "$tmp/requirements.txt" -d "$tmp" >&2
  if ! hash_ok "$tmp/$sdist_name"; then
    echo "reference-templates: $sdist_name does not have the pinned sha256 $sha256" >&2
    exit 1
  fi
  mv "$tmp/$sdist_name" "$sdist"
fi

# Extract into a fresh folder next to the final one, then rename: an interrupted run leaves no
# half-filled templates/ behind a .complete marker.
out=$(mktemp -d "$cache/extract.XXXXXX")
trap 'rm -rf "$out" ${tmp:+"$tmp"}' EXIT
tar -xzf "$sdist" -C "$out" --wildcards --strip-components=5 "$member/*.jinja"
count=$(find "$out" -maxdepth 1 -name '*.jinja' | wc -l)
if [ "$count" -eq 0 ]; then
  echo "reference-templates: no $member/*.jinja in $sdist" >&2
  exit 1
fi
chmod 755 "$out"
touch "$out/.complete"
rm -rf "$templates"
mv "$out" "$templates"
echo "reference-templates: $count templates in $templates" >&2
echo "$templates"
