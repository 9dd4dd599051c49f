#!/usr/bin/env bash
# Durable acquires per second in cluster mode, beside etcd's own lease
# grants per second, measured in one run against the same etcd.
#
#   benches/cluster-acquire.sh [SECONDS] [CLIENTS]     # defaults: 10 64
#
# Starts a one-member etcd (the test suite installs etcd-server) on free
# loopback ports and fencegate (release build) as that cluster's only
# member; once it is primary, wrk drives CLIENTS connections of acquires,
# each on a lease and holder of its own (every grant is in an etcd
# transaction before it is answered, snapshots included as they fall due),
# then CLIENTS connections of etcd lease grants (POST /v3/lease/grant,
# etcd's cheapest durable write), three times each, alternating, so drift
# on a shared machine hits both. Prints each run and the ratio of the
# medians. Needs wrk, etcd, curl.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
clients=${2:-64}

cargo build --release --quiet
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
client=$(port) peer=$(port)
etcd --name bench --data-dir "$work/etcd" \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "bench=http://127.0.0.1:$peer" 2>"$work/etcd.log" &
pids+=($!)
for _ in $(seq 100); do curl -sf -X POST -d '{}' "http://127.0.0.1:$client/v3/maintenance/status" >/dev/null && break; sleep 0.1; done

# Acquires never reach the upstream; cluster mode needs one all members share.
# wrk's clients share one address: the per-client acquire rate is off here.
FENCEGATE_LOG=warn FENCEGATE_LEASES__ACQUIRE_RATE_PER_CLIENT=0 target/release/fencegate serve --listen 127.0.0.1:0 \
    --upstream "http://127.0.0.1:$(port)" --etcd "http://127.0.0.1:$client" --name bench >"$work/fencegate.out" 2>"$work/fencegate.log" &
pids+=($!)
for _ in $(seq 100); do grep -q listening "$work/fencegate.out" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's|^fencegate listening on http://||p' "$work/fencegate.out")
for _ in $(seq 100); do curl -sf "http://$addr/_fence/readyz" >/dev/null && break; sleep 0.1; done

cat >"$work/acquire.lua" <<'LUA'
-- A lease and holder of its own per request: "b<round>-<thread>-<n>".
local n = 0
local id = 0
local ids = 0
local tag = ""
function setup(thread) ids = ids + 1; thread:set("id", ids) end
function init(args) id = wrk.thread:get("id"); tag = args[1] or "" end
request = function()
    n = n + 1
    local name = "b" .. tag .. "-" .. id .. "-" .. n
    return wrk.format("POST", "/_fence/leases/" .. name,
        {["Content-Type"] = "application/json"},
        '{"holder":"' .. name .. '","ttl_ms":600000}')
end
LUA
cat >"$work/grant.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"TTL":600}'
wrk.headers["Content-Type"] = "application/json"
LUA

rate() { awk '/Requests\/sec/ {print $2}'; }
run() {
    local what=$1 url=$2 script=$3 round=$4
    local r
    r=$(wrk -t2 -c"$clients" -d"${seconds}s" -s "$script" "$url" -- "$round" | tee "$work/$what.wrk" | rate)
    if grep -q "Non-2xx" "$work/$what.wrk"; then
        echo "$what: non-2xx answers:" >&2; cat "$work/$what.wrk" >&2; exit 1
    fi
    echo "$r"
}
acq=() grant=()
for round in 1 2 3; do
    acq+=("$(run acquire "http://$addr" "$work/acquire.lua" "$round")")
    grant+=("$(run grant "http://127.0.0.1:$client/v3/lease/grant" "$work/grant.lua" "$round")")
    echo "round $round: fencegate acquires ${acq[-1]}/s, etcd lease grants ${grant[-1]}/s ($clients clients, ${seconds}s each)"
done
python3 - "${acq[@]}" "${grant[@]}" <<'PY'
import statistics, sys
v = [float(x) for x in sys.argv[1:]]
a, g = statistics.median(v[:len(v)//2]), statistics.median(v[len(v)//2:])
print(f"durable acquires / etcd lease grants: {a:.0f} / {g:.0f} = {a/g:.2f}x")
PY
