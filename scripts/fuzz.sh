#!/usr/bin/env bash
# Fuzzes keel's parsers of untrusted input with libFuzzer + AddressSanitizer + UBSan.
#
#   scripts/fuzz.sh                          every target, 600 s each
#   scripts/fuzz.sh --seconds 60 recipe      one target, 60 s
#   scripts/fuzz.sh --list                   the targets
#   scripts/fuzz.sh --build-only             build and write the seed corpora, run nothing
#
# Run it at normal priority and leave it running: libFuzzer's -timeout (10 s per input) is wall
# time, so a fuzzer starved of CPU (nice 19 beside busy jobs) or stopped reports inputs that run
# in 0.2 s as timeouts. Replay an artifact to check: build-fuzz/fuzz/fuzz_<target> <file>.
#
# Not part of CI (it takes targets x seconds). It installs clang when missing (apt-get: kept out of
# scripts/install-deps.sh, which only the normal build needs), builds the "fuzz" preset into
# build-fuzz/, writes the starting corpora with keel's own writers (fuzz/seed_corpus.cpp) plus the
# repository's sample files and the saved regressions (tests/data/fuzz/<target>/), then runs each
# target. What it finds is kept:
#   build-fuzz/fuzz-corpus/<target>/      the grown corpus (reused by the next run)
#   build-fuzz/fuzz-artifacts/<target>/   crash-*, leak-*, timeout-*, oom-* inputs
#   build-fuzz/fuzz-logs/<target>.log     libFuzzer's output
# A crash becomes a regression test: minimise it (build-fuzz/fuzz/fuzz_<target> -minimize_crash=1
# -runs=10000 <crash file>), store it under tests/data/fuzz/<target>/ and add a case to
# tests/unit/fuzz_regressions_test.cpp. Environment: KEEL_JOBS (build parallelism), KEEL_FUZZ_RSS_MB
# (memory limit per target, default 2048: an allocation above it is reported as a bug).
set -euo pipefail
cd "$(dirname "$0")/.."

targets_all=(safetensors safetensors_index model_config recipe token_records checkpoint sharded_checkpoint rank_table tokenizer_json tiktoken records shard peft_adapter_config chat_template preference_pairs llama_cpp_vocab gguf sentencepiece_model)
seconds=600
build_only=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --build-only) build_only=1; shift ;;
    --list) printf '%s\n' "${targets_all[@]}"; exit 0 ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${targets_all[@]}")
for t in "${targets[@]}"; do
  [[ " ${targets_all[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (--list)" >&2; exit 2; }
done

# clang 16 with libFuzzer and the sanitizer runtimes (the "fuzz" preset names clang++-16: Debian
# 12's default clang 14 cannot compile lambdas that capture structured bindings).
if ! command -v clang++-16 >/dev/null 2>&1 || [ ! -f /usr/lib/llvm-16/lib/clang/16/lib/linux/libclang_rt.fuzzer-x86_64.a ]; then
  echo "fuzz.sh: installing clang-16 and libclang-rt-16-dev (libFuzzer, sanitizer runtimes)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends clang-16 libclang-rt-16-dev
fi
symbolizer=$(command -v llvm-symbolizer llvm-symbolizer-16 llvm-symbolizer-14 2>/dev/null | head -n1 || true)
if [ -z "$symbolizer" ]; then  # stack traces with function names and lines
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends llvm-16
  symbolizer=/usr/bin/llvm-symbolizer-16
fi
scripts/install-deps.sh >/dev/null

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "${KEEL_JOBS:-$(nproc)}"

bin=build-fuzz/fuzz
seeds=build-fuzz/fuzz-seeds
rm -rf "$seeds"
"$bin/fuzz_seed_corpus" "$seeds"
cp recipes/*.toml "$seeds/recipe/" 2>/dev/null || true
for f in tests/data/*/config.json; do [ -f "$f" ] && cp "$f" "$seeds/model_config/$(basename "$(dirname "$f")")-config.json"; done
for t in "${targets_all[@]}"; do
  mkdir -p "$seeds/$t"
  if [ -d "tests/data/fuzz/$t" ]; then cp tests/data/fuzz/"$t"/* "$seeds/$t/" 2>/dev/null || true; fi
done
[ "$build_only" -eq 0 ] || { echo "fuzz.sh: built; seeds in $seeds"; exit 0; }

# Dictionaries: JSON and TOML punctuation and the keys each format has.
dict_for() {
  case "$1" in
    recipe) echo fuzz/dict/toml.dict ;;
    rank_table) echo fuzz/dict/rank_table.dict ;;
    tiktoken | sentencepiece_model) echo "" ;;
    chat_template) echo fuzz/dict/jinja.dict ;;
    *) echo fuzz/dict/json.dict ;;
  esac
}

mkdir -p build-fuzz/fuzz-logs
# The targets write their inputs under KEEL_FUZZ_TMP (tmpfs); a crashing target exits without
# cleaning up, so the whole directory goes at the end.
KEEL_FUZZ_TMP=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo /tmp )/keel-fuzz.XXXXXX")
export KEEL_FUZZ_TMP
trap 'rm -rf "$KEEL_FUZZ_TMP"' EXIT
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:symbolize=1"
export ASAN_SYMBOLIZER_PATH="${ASAN_SYMBOLIZER_PATH:-$symbolizer}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
summary=()
failed=0
for t in "${targets[@]}"; do
  corpus=build-fuzz/fuzz-corpus/$t
  artifacts=build-fuzz/fuzz-artifacts/$t
  log=build-fuzz/fuzz-logs/$t.log
  mkdir -p "$corpus" "$artifacts"
  dict=$(dict_for "$t")
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb="${KEEL_FUZZ_RSS_MB:-2048}" -max_len=65536
        -print_final_stats=1 -artifact_prefix="$artifacts/")
  [ -n "$dict" ] && args+=(-dict="$dict")
  echo "fuzz.sh: $t for ${seconds}s (log: $log)"
  status=0
  "$bin/fuzz_$t" "${args[@]}" "$corpus" "$seeds/$t" >"$log" 2>&1 || status=$?
  # libFuzzer's last status line ("#N DONE cov: C ft: F corp: K/S ...") and final stats.
  line=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -n1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$line")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$line")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$line")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
  verdict=ok
  if [ "$status" -ne 0 ]; then
    verdict="FAILED (exit $status): $(ls -t "$artifacts" | head -n1)"
    failed=1
  fi
  summary+=("$(printf '%-18s %8s s %10s execs %7s exec/s  cov %5s  ft %6s  corpus %-12s rss %5s MB  %s' \
    "$t" "$seconds" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "${rss:-?}" "$verdict")")
  echo "  ${summary[-1]}"
done

echo
echo "fuzz.sh: summary (cov = instrumented edges reached, ft = libFuzzer features)"
printf '%s\n' "${summary[@]}"
exit $failed
