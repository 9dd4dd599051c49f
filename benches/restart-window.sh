#!/usr/bin/env bash
# How soon writes go out after kill -9 of a quiescent store and a restart
# (the restart window holds back only leases whose writes may be unfinished).
#
#   benches/restart-window.sh [RUNS]     # default: 3
#
# Each run starts fencegate (release build, embedded backend, a fresh data
# directory, the default settings: a 31 s restart window), makes term 2 of
# lease `calm` (granted with nothing in flight) and releases term 1 of
# lease `handed` with nothing in flight, kills it with SIGKILL, starts it
# again on the same data, and prints when it listened, when term 2 of
# `calm` had its first write answered, and when a new term of `handed` had
# its first write answered, each from the restart. Needs python3.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
cargo build --release --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for _ in $(seq "$runs"); do
    rm -rf "$work/data"
    python3 - target/release/fencegate "$work/data" <<'PY'
import json, re, signal, subprocess, sys, time, urllib.error, urllib.request

binary, data = sys.argv[1], sys.argv[2]

def start():
    p = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    url = re.search(r"http://[0-9.:]+", p.stdout.readline()).group(0)
    return p, url, t0

def call(url, method, path, body=None, headers=None):
    r = urllib.request.Request(url + path, method=method, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(r) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

def acquire(url, lease, holder):
    body = json.dumps({"holder": holder, "ttl_ms": 60000}).encode()
    _, b = call(url, "POST", f"/_fence/leases/{lease}", body, {"content-type": "application/json"})
    v = json.loads(b)
    return {"Fencing-Token": str(v["token"]), "Fencing-Lease-Id": v["lease_id"]}

def put(url, lease, held):
    return call(url, "PUT", f"/kv/{lease}/k", b"v", held)[0]

p, url, _ = start()
one = acquire(url, "calm", "A")
put(url, "calm", one)
call(url, "DELETE", "/_fence/leases/calm", None, one)
calm = acquire(url, "calm", "B")
put(url, "calm", calm)
one = acquire(url, "handed", "A")
put(url, "handed", one)
call(url, "DELETE", "/_fence/leases/handed", None, one)
p.send_signal(signal.SIGKILL)
p.wait()

p, url, t0 = start()
ms = lambda: (time.monotonic() - t0) * 1000
listened = ms()
calm_status = put(url, "calm", calm)
calm_ms = ms()
handed = acquire(url, "handed", "C")
handed_status = put(url, "handed", handed)
handed_ms = ms()
p.send_signal(signal.SIGKILL)
p.wait()
print(f"listening {listened:.1f} ms; calm term {calm['Fencing-Token']} write {calm_status} "
      f"at {calm_ms:.1f} ms; handed term {handed['Fencing-Token']} write {handed_status} "
      f"at {handed_ms:.1f} ms (from the restart)")
PY
done
