#!/usr/bin/env bash
# keel rank-table and keel launch --dry-run end to end: a table written from an hccn.conf passes
# --check, a placeholder or a broken table fails it with exit status 2 naming the entry, and launch
# builds the mpirun command from the hostfile written next to the table.
source "$(dirname "$0")/cli_test_lib.sh"

# expect STATUS TEXT COMMAND...: runs it, checks the exit status and that the output has TEXT.
expect() {
  local want=$1 text=$2
  shift 2
  local out status
  out=$("$@" 2>&1)
  status=$?
  if [ "$status" -ne "$want" ]; then
    fail "$*: exit status $status, expected $want: $out"
  elif ! grep -qF -- "$text" <<<"$out"; then
    fail "$*: output lacks '$text': $out"
  else
    echo "ok   $*"
  fi
}

printf 'address_0=192.168.100.101\naddress_1=192.168.101.101\naddress_2=192.168.102.101\naddress_3=192.168.103.101\n' \
  > "$work/hccn.conf"
cd "$work"
expect 0 "wrote rank_table.json: 1 server, 4 devices (ranks 0-3), topology hccs_full_mesh" \
  "$keel" rank-table --npu-count 4 --topology hccs_full_mesh --server-id 10.0.0.1 --hccn-conf "$work/hccn.conf" \
  --hostfile "$work/hosts" --rankfile "$work/ranks"
expect 0 "valid rank table, version 1.0: 1 server, 4 devices" "$keel" rank-table --check rank_table.json
grep -q '"device_id": "3", "device_ip": "192.168.103.101", "rank_id": "3"' rank_table.json || fail "device 3 entry: $(cat rank_table.json)"
if [ -x /usr/bin/python3 ]; then
  /usr/bin/python3 - rank_table.json <<'PY' || fail "python's json reads the table differently"
import json, sys
t = json.load(open(sys.argv[1]))
assert t["version"] == "1.0" and t["status"] == "completed" and t["server_count"] == "1", t
devices = t["server_list"][0]["device"]
assert all(isinstance(v, str) for d in devices for v in d.values()), devices
assert [d["rank_id"] for d in devices] == ["0", "1", "2", "3"], devices
PY
fi
grep -qx "10.0.0.1 slots=4" hosts || fail "hostfile: $(cat hosts)"
[ "$(grep -c '^rank [0-3]=10.0.0.1 slot=' ranks)" -eq 4 ] || fail "rankfile: $(cat ranks)"

expect 0 '"device_ip": "FILL_IN_DEVICE_IP"' "$keel" rank-table --npu-count 2 --server-id 10.0.0.1 \
  --hccn-conf "$work/absent.conf" --out -
"$keel" rank-table --npu-count 2 --server-id 10.0.0.1 --hccn-conf "$work/absent.conf" --out placeholder.json 2>/dev/null
expect 2 'device[1] (device_id "1"): device_ip is still the placeholder' "$keel" rank-table --check placeholder.json
expect 2 "--topology pcie: devices 2,3,4,5 span the two HCCS islands" \
  "$keel" rank-table --devices 2,3,4,5 --topology pcie --server-id 10.0.0.1 --out -
expect 2 "topology 'nvlink'" "$keel" rank-table --npu-count 2 --topology nvlink --out -

sed 's/"rank_id": "3"/"rank_id": "1"/' rank_table.json > duplicate.json
expect 2 'rank_id 1 duplicates' "$keel" rank-table --check duplicate.json
sed 's/"rank_id": "3"/"rank_id": 3/' rank_table.json > integer.json
expect 0 "rank_id is an integer" "$keel" rank-table --check integer.json

printf 'max_steps = 1\n' > recipe.toml
expect 0 "--map-by ppr:" "$keel" launch -n 2 --dry-run recipe.toml --set dp_degree=2
expect 0 "train recipe.toml --set dp_degree=4" "$keel" launch -n 4 --hostfile hosts --dry-run recipe.toml --set dp_degree=4
expect 0 "--rankfile ranks" "$keel" launch -n 4 --hostfile hosts --rankfile ranks --dry-run recipe.toml
printf '10.0.0.1 slots=2\n10.0.0.2 slots=2\n' > two-hosts
expect 2 "3 ranks do not divide evenly over its 2 hosts" "$keel" launch -n 3 --hostfile two-hosts --dry-run recipe.toml
expect 2 "absent.toml: no such recipe file" "$keel" launch -n 2 --dry-run absent.toml

finish "rank-table ok"
