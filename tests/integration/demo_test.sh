#!/usr/bin/env bash
# The README's demo: trains from scratch and must print a real accuracy gain on held-out problems;
# with --dpo its preference stage must prefer the right answer on most held-out pairs and keep the
# held-out chat accuracy.
set -eu
keel=$1
keel=$(realpath "$keel")
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# A relative --work, as scripts/demo.sh passes it: the recipe the demo writes must resolve against
# its own directory.
cd "$root"
work=build/demo
out=$("$keel" demo --work "$work" --dpo 2>&1)
echo "$out"
line=$(grep -E "accuracy on [0-9]+ held-out problems" <<<"$out") || { echo "FAIL: no accuracy line"; exit 1; }
before=$(sed -E 's/.*: ([0-9.]+)% before training.*/\1/' <<<"$line")
after=$(sed -E 's/.*-> ([0-9.]+)% after.*/\1/' <<<"$line")
awk -v b="$before" -v a="$after" 'BEGIN { exit !(a >= 80 && a - b >= 50) }' ||
  { echo "FAIL: accuracy $before% -> $after% is not a real gain"; exit 1; }
test -s "$work/run/metrics.jsonl" || { echo "FAIL: no metrics.jsonl"; exit 1; }
test -s "$work/run/final/config.json" || { echo "FAIL: no exported model"; exit 1; }
line=$(grep -E "preference stage: the right answer preferred" <<<"$out") || { echo "FAIL: no preference line"; exit 1; }
held=$(sed -E 's/.* and ([0-9.]+)% of [0-9]+ held-out pairs.*/\1/' <<<"$line")
dpo=$(sed -E 's/.*-> ([0-9.]+)% after DPO.*/\1/' <<<"$line")
awk -v h="$held" -v d="$dpo" 'BEGIN { exit !(h >= 60 && d >= 80) }' ||
  { echo "FAIL: held-out reward accuracy $held% or chat accuracy $dpo% after DPO"; exit 1; }
test -s "$work/dpo/final/config.json" || { echo "FAIL: no DPO model"; exit 1; }
echo "demo ok: $before% -> $after%; DPO: held-out reward accuracy $held%, chat accuracy $dpo%"
