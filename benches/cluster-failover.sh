#!/usr/bin/env bash
# Failover as a user meets it, with the default settings (cluster.ttl_ms
# 10 s, margin 1 s, proxy.timeout_ms 30 s, fence.settle_ms 1 s).
#
#   benches/cluster-failover.sh [RUNS]     # default: 1
#
# Starts a one-member etcd on free loopback ports, a recording backend and
# two members (release build); once one is primary: lease `orders` is
# acquired and written, lease `done` acquired, written and released; then the
# primary gets SIGKILL. Prints, from the kill: when a write of `orders`'
# same term was first acknowledged by the other member, what a new term of
# `orders` (its term was live at the kill) is answered, and when a new term
# of `done` (released with nothing in flight) first wrote. Needs etcd, curl.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
cargo build --release --quiet
bin=target/release/fencegate
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ms() { date +%s%3N; }
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
for _ in $(seq "$runs"); do
    work=$(mktemp -d)
    pids=()
    client=$(port) peer=$(port) backend=$(port) m1=$(port) m2=$(port)
    etcd --name bench --data-dir "$work/etcd" --log-level error \
        --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "bench=http://127.0.0.1:$peer" 2>"$work/etcd.log" &
    pids+=($!)
    $bin backend --listen "127.0.0.1:$backend" --record >/dev/null 2>&1 &
    pids+=($!)
    declare -A member
    for m in $m1 $m2; do
        $bin serve --listen "127.0.0.1:$m" --upstream "http://127.0.0.1:$backend" \
            --etcd "http://127.0.0.1:$client" --name "m$m" >/dev/null 2>"$work/m$m.log" &
        member[$m]=$!
        pids+=($!)
    done
    cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
    trap cleanup EXIT
    until primary=$(curl -s "http://127.0.0.1:$m1/_fence/cluster" | grep -o '"primary":{[^}]*}' | grep -o 'http://[0-9.:]*'); do sleep 0.2; done
    p=${primary##*:}
    other=$m1; [[ $other == "$p" ]] && other=$m2
    grant() { curl -s -X POST "$primary/_fence/leases/$1" -H 'content-type: application/json' -d "{\"holder\":\"$2\",\"ttl_ms\":60000}"; }
    put() { curl -s -o /dev/null -w '%{http_code}' -X PUT "$1/kv/$2/k" -d v -H "Fencing-Token: $3" -H "Fencing-Lease-Id: $4"; }
    o=$(grant orders A); ot=$(echo "$o" | json '["token"]'); oid=$(echo "$o" | json '["lease_id"]')
    put "$primary" orders "$ot" "$oid" >/dev/null
    d=$(grant done A); dt=$(echo "$d" | json '["token"]'); did=$(echo "$d" | json '["lease_id"]')
    put "$primary" done "$dt" "$did" >/dev/null
    curl -s -o /dev/null -X DELETE "$primary/_fence/leases/done" -H "Fencing-Token: $dt" -H "Fencing-Lease-Id: $did"
    killed=$(ms)
    kill -9 "${member[$p]}"
    new="http://127.0.0.1:$other"
    until [[ $(put "$new" orders "$ot" "$oid") == 2* ]]; do sleep 0.05; done
    same=$(( $(ms) - killed ))
    curl -s -o /dev/null -X DELETE "$new/_fence/leases/orders" -H "Fencing-Token: $ot" -H "Fencing-Lease-Id: $oid"
    o2=$(curl -s -X POST "$new/_fence/leases/orders" -H 'content-type: application/json' -d '{"holder":"B","ttl_ms":60000}')
    o2t=$(echo "$o2" | json '["token"]'); o2id=$(echo "$o2" | json '["lease_id"]')
    answer=$(curl -s -D - -o /dev/null -X PUT "$new/kv/orders/k" -d v -H "Fencing-Token: $o2t" -H "Fencing-Lease-Id: $o2id" | tr -d '\r' | grep -iE '^(HTTP|retry-after)' | tr '\n' ' ')
    at=$(( $(ms) - killed ))
    d2=$(curl -s -X POST "$new/_fence/leases/done" -H 'content-type: application/json' -d '{"holder":"B","ttl_ms":60000}')
    d2t=$(echo "$d2" | json '["token"]'); d2id=$(echo "$d2" | json '["lease_id"]')
    status=$(put "$new" done "$d2t" "$d2id")
    done_ms=$(( $(ms) - killed ))
    echo "same term wrote again ${same} ms after kill -9; a new term of orders at ${at} ms: ${answer}; a new term of done wrote (${status}) at ${done_ms} ms"
    cleanup
    trap - EXIT
done
