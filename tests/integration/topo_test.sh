#!/usr/bin/env bash
# keel topo on this machine prints its real layout: the hardware-thread count the OS reports
# (nproc), its NUMA nodes, and a rank placement with link classes. Also: an XML export reads back
# as the same machine, a synthetic two-socket machine shows cross-socket links, bad input exits 2.
source "$(dirname "$0")/cli_test_lib.sh"

out=$("$keel" topo 2>&1)
status=$?
echo "$out"
[ "$status" -eq 0 ] || fail "keel topo: exit status $status"
threads=$(nproc)
summary=$(grep -E "^  [0-9]+ sockets?, [0-9]+ NUMA nodes?, " <<<"$out")
grep -qE ", $threads hardware threads?$" <<<"$summary" || fail "summary '$summary' lacks nproc's $threads hardware threads"
if command -v lscpu >/dev/null; then
  cores=$(lscpu -p=core,socket | grep -v '^#' | sort -u | wc -l)
  grep -qE ", $cores cores?, " <<<"$summary" || fail "summary '$summary' lacks lscpu's $cores cores"
fi
grep -q "NUMA node 0" <<<"$out" || fail "no NUMA node listed"
grep -qE "^ranks: [0-9]+ " <<<"$out" || fail "no rank placement"
grep -qE "^link classes between ranks|one rank, nothing to link" <<<"$out" || fail "no link classes"

"$keel" topo --export-xml "$work/this.xml" >/dev/null || fail "--export-xml failed"
again=$("$keel" topo --xml "$work/this.xml" 2>&1) || fail "--xml of the export failed: $again"
grep -qF -- "$summary" <<<"$again" || fail "the XML export reads back differently: $(grep -E '^  [0-9]+ socket' <<<"$again")"

synthetic=$("$keel" topo --synthetic "pack:2 numa:2 l3:2 core:4 pu:2" --ranks 4 2>&1) || fail "--synthetic failed: $synthetic"
grep -q "pairs: 2 same socket, 4 cross-socket" <<<"$synthetic" || fail "synthetic two-socket machine: $synthetic"
grep -q -- "--map-by ppr:1:numa:PE=8 --bind-to core" <<<"$synthetic" || fail "synthetic binding: $synthetic"

bad=$("$keel" topo --xml "$work/absent.xml" 2>&1)
status=$?
{ [ "$status" -eq 2 ] && grep -q "absent.xml: no such file" <<<"$bad"; } || fail "missing XML: status $status, '$bad'"

finish "topo ok"
