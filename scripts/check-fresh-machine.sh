#!/usr/bin/env bash
# Proves the README's two commands on a fresh Debian 12: builds (once, then reuses) a clean
# `debootstrap --variant=minbase bookworm` root, copies a clean clone of the current commit into a
# throw-away copy of it, and runs the commands there under chroot, as a new user's machine would.
#
#   scripts/check-fresh-machine.sh                 demo, then every test (scripts/demo.sh, scripts/test.sh),
#                                                  then `pip install .` and the Python package's tests
#   scripts/check-fresh-machine.sh --configure-only  install-deps + the Python environment + CMake configure
#                                                  (the cheap part CI runs on every submission)
#   scripts/check-fresh-machine.sh --keep          leave the root in place afterwards (its path is printed)
#
# Only committed work is checked (uncommitted changes are not in the clone). Needs root (chroot,
# mounts); installs debootstrap when it is missing. The pristine root is cached as a tarball under
# KEEL_FRESH_CACHE (default /var/cache/keel-fresh-root); delete it to rebuild it with debootstrap.
#
# The machine's certificate bundle and its CA variables (SSL_CERT_FILE, PIP_CERT,
# NODE_EXTRA_CA_CERTS, ...) are carried into the root, as a user behind a TLS-inspecting proxy
# would set them up: a bare root has neither, and pip and npm would fail TLS.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

mode=full
keep=0
for arg in "$@"; do
  case "$arg" in
    --configure-only) mode=configure ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "check-fresh-machine: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "check-fresh-machine: needs root (chroot and mounts)" >&2; exit 2; }

# debootstrap picks its own default mirror; KEEL_DEBIAN_MIRROR names another (a local one, say).
mirror_args=()
[ -z "${KEEL_DEBIAN_MIRROR:-}" ] || mirror_args=("$KEEL_DEBIAN_MIRROR")
cache=${KEEL_FRESH_CACHE:-/var/cache/keel-fresh-root}
tarball=$cache/bookworm-minbase.tar
mkdir -p "$cache"

if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  }
  echo "check-fresh-machine: debootstrap --variant=minbase bookworm ${mirror_args[*]:-(its default mirror)} (cached in $tarball)"
  build=$(mktemp -d "$cache/build.XXXXXX")
  debootstrap --variant=minbase bookworm "$build" "${mirror_args[@]}" >"$cache/debootstrap.log" 2>&1 || {
    tail -20 "$cache/debootstrap.log"; rm -rf "$build"; exit 1; }
  # The apt lists debootstrap leaves are dropped: a new user's machine runs apt-get update.
  rm -rf "$build"/var/lib/apt/lists/* "$build"/var/cache/apt/archives/*.deb
  tar -C "$build" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$build"
fi

root=$(mktemp -d /var/tmp/keel-fresh.XXXXXX)
mounted=()
child=""
cleanup() {
  local status=$?
  # Interrupted: stop what runs in the root first (it is a process group of its own), or the
  # build would go on in the background and keep the mounts busy.
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
    kill -TERM -- "-$child" 2>/dev/null || true
    sleep 2
    kill -KILL -- "-$child" 2>/dev/null || true
  fi
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -l "${mounted[i]}" 2>/dev/null || true
  done
  # Mounts the tests made inside the root (ip netns bind-mounts its /run/netns) are not in
  # `mounted`: left there, the root was never removed and each run kept its 9 GB until the disk
  # filled. Deepest first, only below the root.
  awk -v root="$root/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  if [ "$keep" -eq 1 ]; then
    echo "check-fresh-machine: root kept at $root"
  else
    # Only after every mount is gone: rm -rf must never reach the host's /proc, /sys or /dev.
    if ! grep -q " $root/" /proc/mounts; then rm -rf "$root"; fi
  fi
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

tar -C "$root" -xf "$tarball"
for fs in proc sys dev dev/pts; do
  mount --bind "/$fs" "$root/$fs"
  mounted+=("$root/$fs")
done
cp /etc/resolv.conf "$root/etc/resolv.conf"

# The certificate bundle, at a path of its own (installing ca-certificates in the root regenerates
# /etc/ssl/certs/ca-certificates.crt), and the CA variables pointing at it.
bundle=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
cp "$bundle" "$root/etc/host-ca-bundle.crt"
ca=/etc/host-ca-bundle.crt
env_vars=(
  HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
  SSL_CERT_FILE=$ca PIP_CERT=$ca REQUESTS_CA_BUNDLE=$ca CURL_CA_BUNDLE=$ca NODE_EXTRA_CA_CERTS=$ca
  GIT_SSL_CAINFO=$ca npm_config_cafile=$ca
)

# A clean clone of the current commit: what a new user gets, nothing from this working tree.
commit=$(git rev-parse HEAD)
git clone -q --no-local "$repo" "$root/root/keel"
git -C "$root/root/keel" checkout -q "$commit"
echo "check-fresh-machine: commit $commit in a fresh Debian 12 root ($root)"

in_root() {  # in_root NAME COMMAND: runs COMMAND in the clone inside the root, timed
  local name=$1 cmd=$2 start end status=0
  start=$(date +%s)
  # In its own session (setsid), in the background, so that `wait` returns on a signal and the
  # cleanup can end the whole group.
  setsid chroot "$root" /usr/bin/env -i "${env_vars[@]}" CI="${CI:-}" /bin/bash -c "cd /root/keel && $cmd" \
    >"$root/$name.log" 2>&1 &
  child=$!
  wait "$child" || status=$?
  child=""
  end=$(date +%s)
  cp "$root/$name.log" "$cache/last-$name.log"
  if [ $status -eq 0 ]; then
    echo "check-fresh-machine: $name: passed in $((end - start)) s (log: $cache/last-$name.log)"
  else
    echo "check-fresh-machine: $name: FAILED (exit $status) after $((end - start)) s; its last lines:"
    tail -40 "$root/$name.log" | sed 's/^/    /'
  fi
  return $status
}

status=0
if [ "$mode" = configure ]; then
  in_root configure 'scripts/install-deps.sh && scripts/python-env.sh >/dev/null && scripts/build.sh --configure-only' || status=$?
else
  in_root demo 'scripts/demo.sh' || status=$?
  in_root test 'scripts/test.sh' || status=$?
  # The Python package as a user installs it: `pip install .` (build dependencies from PyPI, the
  # build/ that scripts/test.sh left reused), then its tests against the installed package, the
  # `keel` command pip put on the environment's PATH and the article's rank-table module.
  in_root package 'python=$(scripts/python-env.sh) && "$python" -m pip install -q . && cd / &&
    "$python" -m pytest -q -p no:cacheprovider /root/keel/tests/python &&
    "$(dirname "$python")/keel" --version &&
    "$python" -m keel.rank_table --npu_count 4 --topology hccs_full_mesh --out /tmp/rank_table.json' || status=$?
fi
exit $status
