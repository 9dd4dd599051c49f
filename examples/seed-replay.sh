#!/usr/bin/env bash
# Replays the seed scenario over HTTP with curl against fencegate on the manual
# clock: one line per step (status and reason), then PASS, or FAIL and a
# non-zero exit on the first mismatch.
#
#   examples/seed-replay.sh                  # starts its own fencegate
#   examples/seed-replay.sh http://127.0.0.1:8080   # a running `fencegate serve --clock manual`
#
# Without a URL it runs $FENCEGATE_BIN (default: target/release/fencegate, else
# target/debug/fencegate) on a free loopback port and stops it by its pid.
set -euo pipefail

tmp=$(mktemp -d)
pid=
cleanup() {
    if [[ -n "$pid" ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

if [[ $# -ge 1 ]]; then
    base=$1
else
    here=$(cd "$(dirname "$0")/.." && pwd)
    bin=${FENCEGATE_BIN:-}
    if [[ -z "$bin" ]]; then
        for candidate in "$here/target/release/fencegate" "$here/target/debug/fencegate"; do
            if [[ -x "$candidate" ]]; then bin=$candidate; break; fi
        done
    fi
    [[ -n "$bin" ]] || { echo "no fencegate binary: run 'cargo build' or set FENCEGATE_BIN" >&2; exit 2; }
    env -u FENCEGATE_BIN "$bin" serve --listen 127.0.0.1:0 --clock manual --data-dir "$tmp/data" >"$tmp/out" 2>"$tmp/err" &
    pid=$!
    for _ in $(seq 1 100); do
        base=$(sed -n 's/^fencegate listening on \(http:[^ ]*\)$/\1/p' "$tmp/out")
        [[ -n "$base" ]] && break
        kill -0 "$pid" 2>/dev/null || { cat "$tmp/err" >&2; exit 2; }
        sleep 0.05
    done
    [[ -n "$base" ]] || { echo "fencegate did not start" >&2; exit 2; }
fi

now=0
status= body=

# call METHOD PATH [curl args…]: sets $status and $body.
call() {
    local method=$1 path=$2
    shift 2
    status=$(curl -sS -o "$tmp/body" -w '%{http_code}' -X "$method" "$base$path" "$@")
    body=$(cat "$tmp/body")
}

field() { # field NAME: a string or number member of $body
    sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p" <<<"$body"
}

at() { # at SECONDS: advance the manual clock to that time
    local target_ms=$(($1 * 1000))
    call POST /_fence/clock -d "{\"advance_ms\": $((target_ms - now))}"
    [[ "$status" == 200 && "$(field now_ms)" == "$target_ms" ]] || fail "clock did not move to ${1}s: $status $body"
    now=$target_ms
}

fail() { echo "FAIL: $*"; exit 1; }

# expect LABEL STATUS [REASON]: checks the last call and prints the step.
expect() {
    local label=$1 want=$2 reason=${3:-}
    local got_reason
    got_reason=$(field reason)
    printf 't=%-3s %-46s %s %s\n' "$((now / 1000))" "$label" "$status" "${got_reason:-ok}"
    [[ "$status" == "$want" ]] || fail "$label: expected $want, got $status $body"
    [[ -z "$reason" || "$got_reason" == "$reason" ]] || fail "$label: expected $reason, got $got_reason"
}

acquire() { call POST /_fence/leases/orders -d "{\"holder\": \"$1\", \"ttl_ms\": 5000}"; }
write() { call PUT /kv/orders/x -H "Fencing-Token: $1" -H "Fencing-Lease-Id: $2" --data-binary "$3"; }

at 0
acquire A; expect "A acquires (token 1)" 201
[[ "$(field token)" == 1 ]] || fail "A got token $(field token)"
a_id=$(field lease_id)
at 2
write 1 "$a_id" a-1; expect "A writes" 201
at 4
call POST /_fence/leases/orders/renew -H "Fencing-Token: 1" -H "Fencing-Lease-Id: $a_id"
expect "A renews (deadline 9)" 200
[[ "$(field expires_in_ms)" == 5000 ]] || fail "renew: expires_in_ms $(field expires_in_ms)"
at 8
write 1 "$a_id" a-2; expect "A writes" 204
at 10
write 1 "$a_id" a-3; expect "A writes" 412 lease-expired
call POST /_fence/leases/orders/renew -H "Fencing-Token: 1" -H "Fencing-Lease-Id: $a_id"
expect "A renews" 412 lease-expired
acquire B; expect "B acquires (token 2)" 201
[[ "$(field token)" == 2 ]] || fail "B got token $(field token)"
b_id=$(field lease_id)
at 11
write 2 "$b_id" b-1; expect "B writes" 204
at 12
write 1 "$b_id" x; expect "token 1 with B's lease id writes" 412 stale-fencing-token
write 1 "$a_id" a-4; expect "A writes with token 1" 412 stale-fencing-token
acquire C; expect "C acquires" 409 lease-held
call DELETE /_fence/leases/orders -H "Fencing-Token: 1" -H "Fencing-Lease-Id: $a_id"
expect "A releases with token 1" 412 stale-fencing-token
call DELETE /_fence/leases/orders -H "Fencing-Token: 2" -H "Fencing-Lease-Id: $b_id"
expect "B releases" 204
at 13
acquire C; expect "C acquires (token 3)" 201
[[ "$(field token)" == 3 ]] || fail "C got token $(field token)"
c_id=$(field lease_id)
at 14
write 3 "$c_id" c-1; expect "C writes c-1" 204
call GET /kv/orders/x; expect "GET /kv/orders/x" 200
[[ "$body" == c-1 ]] || fail "GET returned '$body', expected 'c-1'"
echo "PASS: seed scenario replayed over HTTP"
