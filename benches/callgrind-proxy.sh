#!/usr/bin/env bash
# Instructions per proxied request in the fencegate process, counted by
# valgrind's callgrind: unlike wall time on a shared machine, the count
# repeats to about one percent, so a change to the hot path can
# be judged by it.
#
#   benches/callgrind-proxy.sh [PATH] [REQUESTS] [FENCEGATE_*=value ...]
#   benches/callgrind-proxy.sh /kv/bench/1 2000                   # fenced PUT
#   benches/callgrind-proxy.sh /raw/bench/1 2000                  # unfenced
#   benches/callgrind-proxy.sh /kv/bench/1 2000 FENCEGATE_PROXY__UPSTREAM_CONNECTIONS=pooled
#   benches/callgrind-proxy.sh /_fence/leases/bench/renew 2000    # renew (POST, no body)
#   benches/callgrind-proxy.sh /kv/bench/1 2000 FENCEGATE_CLUSTER__ETCD=http://127.0.0.1:2379 \
#       FENCEGATE_CLUSTER__NAME=bench                              # cluster mode (a running etcd)
#
# Starts the minimal backend of benches/proxy.rs, fencegate under callgrind
# in front of it (one worker thread), acquires a lease, warms up with 300
# requests, zeroes the counters, sends REQUESTS sequential requests on one
# keep-alive connection (PUTs of 64 bytes; a POST without a body for a path
# ending in /renew), and divides the instruction count by REQUESTS.
# Needs valgrind, curl and python3. Kernel time is not counted. With
# CALLGRIND_OUT=FILE set, the profile is kept there, for
# `callgrind_annotate --inclusive=yes FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
path=${1:-/kv/bench/1}
requests=${2:-2000}
shift $(($# < 2 ? $# : 2))

source benches/bench-lib.sh
start_fencegate "valgrind --tool=callgrind --callgrind-out-file=$work/callgrind.out.%p" \
    FENCEGATE_FENCE__ALLOW_UNROUTED_WRITES=true "$@"
addr=$fg_addr

grant=$(curl -sS -X POST -d '{"holder":"bench","ttl_ms":3600000}' "http://$addr/_fence/leases/bench")
cat >"$work/client.py" <<'EOF'
import http.client, json, sys
addr, path, n, grant = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
host, port = addr.rsplit(":", 1)
conn = http.client.HTTPConnection(host, int(port))
headers = {"Fencing-Token": str(grant["token"]), "Fencing-Lease-Id": grant["lease_id"]}
renew = path.endswith("/renew")
for _ in range(n):
    if renew:
        conn.request("POST", path, headers=headers)
    else:
        conn.request("PUT", path, body=b"x" * 64, headers=headers)
    res = conn.getresponse()
    res.read()
    if res.status >= 300:
        sys.exit(f"{path}: status {res.status}")
EOF
python3 "$work/client.py" "$addr" "$path" 300 "$grant"
callgrind_control -z "$fencegate" >/dev/null 2>&1
python3 "$work/client.py" "$addr" "$path" "$requests" "$grant"
callgrind_control -d "$fencegate" >/dev/null 2>&1
sleep 0.5
dump=$(ls -t "$work"/callgrind.out.*.1 | head -1)
total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
[[ -n "${CALLGRIND_OUT:-}" ]] && cp "$dump" "$CALLGRIND_OUT"
echo "$path: $((total / requests)) instructions per request ($requests requests${*:+, $*})"
