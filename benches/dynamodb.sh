#!/usr/bin/env bash
# What fencing a DynamoDB PutItem costs in fencegate (SPEC §11,
# docs/stores.md): instructions per fenced PutItem in the fencegate process
# (valgrind's callgrind, one worker thread), in front of moto's server, the
# PutItem carrying the token and its condition, a 64-byte value, sequential
# on one keep-alive connection after 300 to warm up.
#
#   benches/dynamodb.sh [REQUESTS]
#   benches/dynamodb.sh 1000          # the figure in docs/stores.md
#
# Needs valgrind, python3 and moto's server from the tests' venv
# (`cargo test` makes it, in ~/.cache/fencegate-tests or
# $FENCEGATE_TEST_CACHE). With CALLGRIND_OUT=FILE set, the profile is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-1000}
cache=${FENCEGATE_TEST_CACHE:-$HOME/.cache/fencegate-tests}
moto=$(ls -d "$cache"/venv-s3-*/bin/moto_server 2>/dev/null | head -1)
[[ -x "$moto" ]] || { echo "no moto_server under $cache: run cargo test first" >&2; exit 1; }

cargo build --release --quiet
# shellcheck source=benches/scratch.sh
source benches/scratch.sh

port=$(free_port)
"$moto" -H 127.0.0.1 -p "$port" >"$work/moto.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -s "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done

cat >"$work/fencegate.toml" <<TOML
[leases]
acquire_rate_per_client = 0
[[fence.routes]]
kind = "dynamodb"
pattern = "/jobs/{lease}"
partition_key = "pk"
TOML

cat >"$work/client.py" <<'PY'
import http.client, json, sys
addr, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
host, port = addr.rsplit(":", 1)
c = http.client.HTTPConnection(host, int(port))
AUTH = "AWS4-HMAC-SHA256 Credential=b/20261207/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=00"

def call(op, body, extra=None):
    headers = {"X-Amz-Target": f"DynamoDB_20120810.{op}", "Content-Type": "application/x-amz-json-1.0",
               "Authorization": AUTH, **(extra or {})}
    c.request("POST", "/", body=json.dumps(body), headers=headers)
    r = c.getresponse()
    return r.status, r.read()

if what == "create":
    status, _ = call("CreateTable", {"TableName": "jobs", "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}],
                                     "AttributeDefinitions": [{"AttributeName": "pk", "AttributeType": "S"}],
                                     "BillingMode": "PAY_PER_REQUEST"})
    sys.exit(0 if status == 200 else f"CreateTable: {status}")
c.request("POST", f"/_fence/leases/{what}", body=json.dumps({"holder": "bench", "ttl_ms": 3600000}))
grant = json.loads(c.getresponse().read())
headers = {"Fencing-Token": str(grant["token"]), "Fencing-Lease-Id": grant["lease_id"]}
token = str(grant["token"])
for i in range(n):
    status, data = call("PutItem", {
        "TableName": "jobs",
        "Item": {"pk": {"S": f"{what}/{i % 100}"}, "v": {"S": "x" * 64}, "fencing_token": {"N": token}},
        "ConditionExpression": "attribute_not_exists(#fencegate_token) OR #fencegate_token <= :fencegate_token",
        "ExpressionAttributeNames": {"#fencegate_token": "fencing_token"},
        "ExpressionAttributeValues": {":fencegate_token": {"N": token}},
    }, headers)
    if status != 200:
        sys.exit(f"PutItem: {status} {data[:200]!r}")
PY
python3 "$work/client.py" "127.0.0.1:$port" 0 create

env FENCEGATE_LOG=warn FENCEGATE_RUNTIME__WORKER_THREADS=1 \
    valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out.%p" \
    target/release/fencegate serve --config "$work/fencegate.toml" --listen 127.0.0.1:0 \
    --upstream "http://127.0.0.1:$port" --data-dir "$work/data" >"$work/fg.out" 2>"$work/fg.log" &
fencegate=$!
pids+=("$fencegate")
for _ in $(seq 600); do grep -q listening "$work/fg.out" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's|^fencegate listening on http://||p' "$work/fg.out")
for _ in $(seq 600); do curl -sf "http://$addr/_fence/readyz" >/dev/null && break; sleep 0.1; done

python3 "$work/client.py" "$addr" 300 warm
callgrind_control -z "$fencegate" >/dev/null 2>&1
python3 "$work/client.py" "$addr" "$requests" bench
callgrind_control -d "$fencegate" >/dev/null 2>&1
sleep 0.5
dump=$(ls -t "$work"/callgrind.out.*.1 | head -1)
total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
[[ -n "${CALLGRIND_OUT:-}" ]] && cp "$dump" "$CALLGRIND_OUT"
echo "fenced DynamoDB PutItem: $((total / requests)) instructions per request in fencegate ($requests requests)"
