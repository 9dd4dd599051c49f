#!/usr/bin/env bash
# What fencing an etcd v3 put costs (SPEC §11, docs/stores.md): a put
# through fencegate (an etcd-v3 route: the body read, the keys mapped to
# their lease, the write sent as a transaction on the lease's fence key,
# etcd's answer reshaped) beside the same put sent straight to etcd.
#
#   benches/etcd-v3.sh [REQUESTS] [LEASES]
#   benches/etcd-v3.sh 2000 5000      # the figures in docs/stores.md
#
# Prints, for one run on this machine:
# - instructions per fenced put in the fencegate process (valgrind's
#   callgrind, one worker thread, REQUESTS sequential puts of a 64-byte value
#   on one keep-alive connection after 300 to warm up): a count that repeats
#   where wall time drifts;
# - wall time per put, direct and fenced, measured side by side in
#   alternating rounds (fencegate a release build without valgrind), and
#   their ratio;
# - the bytes etcd's database grows by per lease for its fence key: LEASES
#   keys written straight, then LEASES keys written through fencegate each
#   under a lease of its own, the growth of etcd's dbSizeInUse compared.
# Needs etcd, valgrind and python3 (the tests install them). With
# CALLGRIND_OUT=FILE set, the profile is kept there, for
# `callgrind_annotate --inclusive=yes FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-2000}
leases=${2:-5000}

cargo build --release --quiet
# shellcheck source=benches/scratch.sh
source benches/scratch.sh


client=$(free_port)
peer=$(free_port)
etcd --data-dir "$work/etcd" --name bench \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "bench=http://127.0.0.1:$peer" >"$work/etcd.log" 2>&1 &
pids+=($!)
etcd_url="http://127.0.0.1:$client"
for _ in $(seq 100); do curl -sf "$etcd_url/health" >/dev/null && break; sleep 0.1; done

cat >"$work/fencegate.toml" <<EOF
[leases]
acquire_rate_per_client = 0
[[fence.routes]]
kind = "etcd-v3"
pattern = "{lease}"
EOF

# serve WRAPPER NAME: fencegate (one worker thread) in front of etcd, under
# WRAPPER; sets $fencegate (its pid) and $addr.
serve() {
    local wrapper=$1 name=$2
    # $wrapper is split into words on purpose.
    # shellcheck disable=SC2086
    env FENCEGATE_LOG=warn FENCEGATE_RUNTIME__WORKER_THREADS=1 $wrapper \
        target/release/fencegate serve --config "$work/fencegate.toml" --listen 127.0.0.1:0 \
        --upstream "$etcd_url" --data-dir "$work/$name" \
        >"$work/$name.out" 2>"$work/$name.log" &
    fencegate=$!
    pids+=("$fencegate")
    for _ in $(seq 600); do grep -q listening "$work/$name.out" 2>/dev/null && break; sleep 0.1; done
    addr=$(sed -n 's|^fencegate listening on http://||p' "$work/$name.out")
    for _ in $(seq 600); do curl -sf "http://$addr/_fence/readyz" >/dev/null && break; sleep 0.1; done
}

cat >"$work/client.py" <<'EOF'
import base64, http.client, json, sys, time

def b64(s):
    return base64.b64encode(s.encode()).decode()

def conn(addr):
    host, port = addr.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port))

def acquire(c, lease):
    c.request("POST", f"/_fence/leases/{lease}", body=json.dumps({"holder": "bench", "ttl_ms": 3600000}))
    r = c.getresponse()
    grant = json.loads(r.read())
    if r.status != 201:
        sys.exit(f"acquire {lease}: {r.status} {grant}")
    return {"Fencing-Token": str(grant["token"]), "Fencing-Lease-Id": grant["lease_id"]}

def put(c, key, headers):
    body = json.dumps({"key": b64(key), "value": b64("x" * 64)})
    c.request("POST", "/v3/kv/put", body=body, headers=headers)
    r = c.getresponse()
    r.read()
    if r.status != 200:
        sys.exit(f"put {key}: status {r.status}")

def puts(addr, n, lease, headers):
    c = conn(addr)
    for i in range(n):
        put(c, f"{lease}/{i % 100}", headers)

def in_use(etcd):
    c = conn(etcd)
    c.request("POST", "/v3/maintenance/status", body="{}")
    return int(json.loads(c.getresponse().read())["dbSizeInUse"])

what = sys.argv[1]
if what == "puts":  # puts ADDR N LEASE: acquire LEASE, N puts
    addr, n, lease = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    puts(addr, n, lease, acquire(conn(addr), lease))
elif what == "grant":  # grant ADDR: the headers of lease "bench", as JSON
    print(json.dumps(acquire(conn(sys.argv[2]), "bench")))
elif what == "timed":  # timed ADDR N HEADERS_JSON: N puts, seconds taken
    addr, n, headers = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    c = conn(addr)
    put(c, "bench/0", headers)
    start = time.perf_counter()
    for i in range(n):
        put(c, f"bench/{i % 100}", headers)
    print(time.perf_counter() - start)
elif what == "bytes":  # bytes ETCD FENCEGATE N: growth per key, direct then fenced
    etcd, addr, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    before = in_use(etcd)
    c = conn(etcd)
    for i in range(n):
        put(c, f"direct{i}/k", {})
    direct = in_use(etcd) - before
    c = conn(addr)
    before = in_use(etcd)
    for i in range(n):
        put(c, f"fenced{i}/k", acquire(c, f"fenced{i}"))
    fenced = in_use(etcd) - before
    print(f"{direct / n:.0f} {fenced / n:.0f}")
EOF

# Instructions per fenced put.
serve "valgrind --tool=callgrind --callgrind-out-file=$work/callgrind.out.%p" callgrind
python3 "$work/client.py" puts "$addr" 300 warm
callgrind_control -z "$fencegate" >/dev/null 2>&1
python3 "$work/client.py" puts "$addr" "$requests" bench
callgrind_control -d "$fencegate" >/dev/null 2>&1
sleep 0.5
dump=$(ls -t "$work"/callgrind.out.*.1 | head -1)
total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
[[ -n "${CALLGRIND_OUT:-}" ]] && cp "$dump" "$CALLGRIND_OUT"
echo "fenced etcd put: $((total / requests)) instructions per request in fencegate ($requests requests)"
kill "$fencegate"

# Wall time, direct and fenced, in alternating rounds.
serve "" plain
grant=$(python3 "$work/client.py" grant "$addr")
direct=0 fenced=0
round=$((requests / 5 > 0 ? requests / 5 : 1))
for _ in 1 2 3 4 5; do
    d=$(python3 "$work/client.py" timed "127.0.0.1:$client" "$round" '{}')
    f=$(python3 "$work/client.py" timed "$addr" "$round" "$grant")
    direct=$(python3 -c "print($direct + $d)")
    fenced=$(python3 -c "print($fenced + $f)")
done
python3 - "$direct" "$fenced" "$((round * 5))" <<'EOF'
import sys
direct, fenced, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
print(f"wall time per put: direct {direct / n * 1e6:.0f} us, through fencegate {fenced / n * 1e6:.0f} us "
      f"({fenced / direct:.2f} x), {n} puts each, alternating rounds")
EOF

# The bytes a fence key adds per lease.
read -r direct_bytes fenced_bytes < <(python3 "$work/client.py" bytes "127.0.0.1:$client" "$addr" "$leases")
echo "etcd's dbSizeInUse per key: $direct_bytes bytes written straight, $fenced_bytes through fencegate (a lease each: its fence key and its two revisions), $leases keys each"
