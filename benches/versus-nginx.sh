#!/usr/bin/env bash
# fencegate's fenced PUT beside nginx proxying the same PUT, counted the same
# way in one run: instructions per request in the proxy's process
# (valgrind's callgrind: the count repeats to about one percent, unlike wall
# time on a shared machine) and system calls per request (strace -c -f).
#
#   benches/versus-nginx.sh [REQUESTS]      # default 2000; CI smoke: 50
#
# Both proxies run one thread of work (nginx: one process, master_process
# off; fencegate: runtime.worker_threads = 1) in front of the minimal
# backend of benches/proxy.rs. One Python client sends the same requests to
# each, sequentially on one keep-alive connection: PUT /kv/bench/1, 64
# bytes, with a valid fencing token and lease id (nginx forwards the
# headers; fencegate checks them). 300 requests warm up first; then the
# counters are zeroed (callgrind_control -z) or strace attaches, REQUESTS
# requests run, and the totals are divided by REQUESTS. Kernel time is not
# counted by callgrind. Needs valgrind, strace, nginx, curl and python3.
#
# The count of one build moves by up to about 1,500 instructions with where
# the process's stack and heap fall (the size of its environment is enough
# to move them), so each proxy is counted in three layouts (an environment
# variable of 0, 300 and 600 bytes) and the median is reported. fencegate is
# the release build users run, not the one the bench target builds with the
# test-util feature (benches/bench-lib.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-2000}

for tool in valgrind callgrind_control callgrind_annotate strace nginx curl python3; do
    command -v "$tool" >/dev/null || {
        echo "versus-nginx.sh needs $tool (apt-get install valgrind strace nginx curl python3)" >&2
        exit 1
    }
done
source benches/bench-lib.sh
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 600); do curl -s -o /dev/null "http://$1/" && return; sleep 0.1; done; echo "$1 never answered" >&2; exit 1; }

stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

nginx_port=$(port)
mkdir -p "$work/nginx"
cat >"$work/nginx/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path $work/nginx/body;
    proxy_temp_path $work/nginx/proxy;
    fastcgi_temp_path $work/nginx/fastcgi;
    uwsgi_temp_path $work/nginx/uwsgi;
    scgi_temp_path $work/nginx/scgi;
    upstream backend { server $backend; keepalive 16; }
    server {
        listen 127.0.0.1:$nginx_port;
        keepalive_requests 1000000;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
start_nginx() { # $1: a wrapper command (may be empty), $2: LAYOUT_PAD
    # $1 is split into words on purpose.
    # shellcheck disable=SC2086
    env LAYOUT_PAD="${2:-}" $1 nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" 2>>"$work/nginx/stderr" &
    nginx=$!
    pids+=("$nginx")
    wait_http "127.0.0.1:$nginx_port"
}

cat >"$work/client.py" <<'EOF'
import http.client, json, sys
addr, n, grant = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
host, port = addr.rsplit(":", 1)
conn = http.client.HTTPConnection(host, int(port))
headers = {"Fencing-Token": str(grant["token"]), "Fencing-Lease-Id": grant["lease_id"]}
for _ in range(n):
    conn.request("PUT", "/kv/bench/1", body=b"x" * 64, headers=headers)
    res = conn.getresponse()
    res.read()
    if res.status >= 300:
        sys.exit(f"{addr}: status {res.status}")
EOF
client() { python3 "$work/client.py" "$1" "$2" "$grant"; }

# Instructions per request under callgrind.
instructions() { # $1: pid, $2: address
    client "$2" 300
    callgrind_control -z "$1" >/dev/null 2>&1
    client "$2" "$requests"
    callgrind_control -d "$1" >/dev/null 2>&1
    local dump
    for _ in $(seq 100); do
        dump=$(ls -t "$work"/callgrind.out.*.1 2>/dev/null | head -1 || true)
        [[ -n "$dump" ]] && break
        sleep 0.1
    done
    local total
    total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    rm -f "$work"/callgrind.out.*
    [[ -n "$total" ]] || { echo "callgrind counted nothing (no profile was written)" >&2; exit 1; }
    echo $((total / requests))
}

# System calls per request, and the calls made at least once per request.
syscalls() { # $1: pid, $2: address, $3: name
    client "$2" 300
    strace -qq -c -f -p "$1" -o "$work/$3.strace" &
    local tracer=$!
    sleep 1 # strace attaches to every thread
    client "$2" "$requests"
    kill -INT "$tracer"
    wait "$tracer" 2>/dev/null || true
    python3 - "$work/$3.strace" "$requests" <<'EOF'
import sys
requests = int(sys.argv[2])
calls = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 5 and f[-1] != "total" and f[3].isdigit():
        calls[f[-1]] = int(f[3])
total = sum(calls.values())
if total == 0:
    sys.exit("strace counted no system calls (could it attach? ptrace may be forbidden)")
each = " ".join(f"{k} {v / requests:.2f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v >= requests / 2)
print(f"{total / requests:.2f} ({each})")
EOF
}

start_fencegate ""
grant=$(curl -sS -X POST -d '{"holder":"bench","ttl_ms":3600000}' "http://$fg_addr/_fence/leases/bench")
fg_sys=$(syscalls "$fencegate" "$fg_addr" fencegate) || exit 1
stop "$fencegate"
pads=(0 300 600)
pad() { printf "%${1}s" "" | tr ' ' x; }
median() { printf '%s\n' "$@" | sort -n | sed -n "$(($# / 2 + 1))p"; }
# The lease is in the data directory: each restarted fencegate holds it.
counts=()
for n in "${pads[@]}"; do
    start_fencegate "valgrind --tool=callgrind --callgrind-out-file=$work/callgrind.out.%p" \
        LAYOUT_PAD="$(pad "$n")"
    counts+=("$(instructions "$fencegate" "$fg_addr")")
    stop "$fencegate"
done
fg_ins=$(median "${counts[@]}")
fg_all=${counts[*]}

start_nginx ""
nginx_sys=$(syscalls "$nginx" "127.0.0.1:$nginx_port" nginx) || exit 1
stop "$nginx"
counts=()
for n in "${pads[@]}"; do
    start_nginx "valgrind --tool=callgrind --callgrind-out-file=$work/callgrind.out.%p" "$(pad "$n")"
    counts+=("$(instructions "$nginx" "127.0.0.1:$nginx_port")")
    stop "$nginx"
done
nginx_ins=$(median "${counts[@]}")
nginx_all=${counts[*]}

echo "PUT /kv/bench/1, 64 bytes, one keep-alive connection, $requests requests each"
printf '%-22s %14s  %s\n' "" "instructions" "syscalls per request"
printf '%-22s %14s  %s\n' "nginx (proxy_pass)" "$nginx_ins" "$nginx_sys"
printf '%-22s %14s  %s\n' "fencegate (fenced)" "$fg_ins" "$fg_sys"
python3 -c "import sys; print(f'fencegate / nginx: {int(sys.argv[1]) / int(sys.argv[2]):.2f}x instructions')" "$fg_ins" "$nginx_ins"
echo "instructions in each layout: nginx $nginx_all; fencegate $fg_all"
