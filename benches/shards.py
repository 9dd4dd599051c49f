#!/usr/bin/env python3
"""Shards against one primary, side by side in one run (not a timed test).

    benches/shards.py [SECONDS] [CLIENTS]        # defaults: 10 48

Starts a one-member etcd (the test suite installs etcd-server) and two
clusters of three fencegate members each (release build) on it, under
prefixes of their own, in front of one `fencegate backend`: one with
`cluster.shards = 1` (one primary), one with 12 shards (four per member).
Clients that use the shard map send each lease's requests to its shard's
primary, so wrk runs one process per member, CLIENTS/3 connections each:
for one shard every process targets the primary; for twelve, each targets
its member with leases of the shards it leads. Three alternating rounds of
durable acquires (a lease and holder of its own per request) and of fenced
writes (64-byte PUTs under terms held by the bench) for each cluster, the
medians, the share of requests the members forwarded to one another (with
the shard map, and with every process sending leases of every shard), and,
once, the failover of each shard of a member killed with SIGKILL (until a
write under a term held there is acknowledged through another member).
Before it, what slow readers of forwarded answers cost the forwarding
member: 200 connections to a member, each pipelining eight fenced GETs of a
1 MiB value whose lease another member leads (the twelve-shard cluster
fences reads, so they are forwarded) and never reading; the forwarding
member's resident size before and once it has settled.
Needs wrk, etcd, curl.
"""

import hashlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
CLIENTS = max(3, int(sys.argv[2]) if len(sys.argv) > 2 else 48)
SHARDS = 12
TTL_MS = 3000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "fencegate")
procs = []


def shard_of(name, n):
    """h(name) mod n: the first 8 bytes of SHA-256, big-endian."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % n


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, log, env=None):
    out = open(log + ".out", "w")
    p = subprocess.Popen(args, stdout=out, stderr=open(log, "w"),
                         env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    procs.append(p)
    return p


def announced(log):
    for _ in range(200):
        m = re.search(r"listening on (http://\S+)", open(log + ".out").read())
        if m:
            return m.group(1)
        time.sleep(0.05)
    sys.exit(f"no address announced in {log}:\n{open(log).read()}")


def http(method, url, body=None, headers=None, timeout=5):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def cluster(url):
    status, body = http("GET", url + "/_fence/cluster")
    return json.loads(body) if status == 200 else None


def forwarded(urls):
    total = 0
    for url in urls:
        _, body = http("GET", url + "/_fence/metrics")
        m = re.search(rb"^fencegate_requests_forwarded_to_member_total (\d+)", body, re.M)
        total += int(m.group(1)) if m else 0
    return total


def wait_for(what, check, within=60):
    deadline = time.time() + within
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    sys.exit(f"timed out waiting for {what}")


def leaders(urls):
    """{shard: url} once every member names a leader for every shard alike."""
    views = [cluster(u) for u in urls]
    if not all(views) or any(v["shards"] != views[0]["shards"] for v in views):
        return None
    if views[0]["shards"] == 1:
        p = views[0]["primary"]
        same = all(v["primary"] == p for v in views)
        return {0: p["url"]} if p and same else None
    maps = [[(l["primary"] or {}).get("url") for l in v["leaders"]] for v in views]
    if any(m != maps[0] for m in maps) or None in maps[0]:
        return None
    return dict(enumerate(maps[0]))


def names_for(target, owner, count, tag, n):
    """`count` lease names whose shard `owner` maps to `target`."""
    out, i = [], 0
    while len(out) < count:
        name = f"{tag}-{i}"
        if owner[shard_of(name, n)] == target:
            out.append(name)
        i += 1
    return out


WRK_ACQUIRE = """
local names = {}
local n = 0
function init(args)
    for line in io.lines(args[1]) do names[#names + 1] = line end
end
request = function()
    n = n + 1
    -- Each name once: past the list, the acquires fail (409) and say so.
    local name = names[(n - 1) % #names + 1]
    return wrk.format("POST", "/_fence/leases/" .. name,
        {["Content-Type"] = "application/json"},
        '{"holder":"' .. name .. '","ttl_ms":600000}')
end
"""

WRK_WRITE = """
local terms = {}
local n = 0
function init(args)
    for line in io.lines(args[1]) do
        local lease, token, id = line:match("(%S+) (%S+) (%S+)")
        terms[#terms + 1] = {lease, token, id}
    end
end
request = function()
    n = n + 1
    local t = terms[(n - 1) % #terms + 1]
    return wrk.format("PUT", "/kv/" .. t[1] .. "/k",
        {["Fencing-Token"] = t[2], ["Fencing-Lease-Id"] = t[3]},
        string.rep("x", 64))
end
"""


def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def settled_rss(pid):
    last = rss(pid)
    for _ in range(60):
        time.sleep(0.5)
        now = rss(pid)
        if abs(now - last) < now / 100:
            return now
        last = now
    return last


def forwarded_slow_readers(urls, pids, owner, readers=200, pipeline=8):
    """A member's resident size while `readers` slow readers of forwarded
    answers (1 MiB each) are held: (before, held) in bytes."""
    here, there = urls[0], next(u for u in urls if u != urls[0])
    name = names_for(there, owner, 1, "slow", SHARDS)[0]
    status, body = http("POST", f"{there}/_fence/leases/{name}", {"holder": "bench", "ttl_ms": 600000})
    if status != 201:
        sys.exit(f"acquire {name}: {status} {body!r}")
    g = json.loads(body)
    headers = {"Fencing-Token": str(g["token"]), "Fencing-Lease-Id": g["lease_id"]}
    req = urllib.request.Request(f"{there}/kv/{name}/v", data=b"x" * (1 << 20), method="PUT",
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert 200 <= r.status < 300, r.status
    host = here.removeprefix("http://")
    get = (f"GET /kv/{name}/v HTTP/1.1\r\nHost: {host}\r\nFencing-Token: {g['token']}\r\n"
           f"Fencing-Lease-Id: {g['lease_id']}\r\n\r\n").encode() * pipeline
    pid = pids[0].pid
    before = settled_rss(pid)
    addr, port_ = host.rsplit(":", 1)
    held = []
    for _ in range(readers):
        s = socket.create_connection((addr, int(port_)))
        s.sendall(get)
        held.append(s)
    during = settled_rss(pid)
    for s in held:
        s.close()
    return before, during


def wrk(work, script, jobs):
    """Runs one wrk per (url, arg file) at once; the summed rate."""
    running = []
    per = max(1, CLIENTS // len(jobs))
    for i, (url, arg) in enumerate(jobs):
        out = os.path.join(work, f"wrk{i}.out")
        running.append((subprocess.Popen(
            ["wrk", "-t1", f"-c{per}", f"-d{SECONDS}s", "-s", script, url, "--", arg],
            stdout=open(out, "w"), stderr=subprocess.STDOUT), out))
    total = 0.0
    for p, out in running:
        p.wait()
        text = open(out).read()
        if "Non-2xx" in text or p.returncode != 0:
            sys.exit(f"wrk: non-2xx answers or failure:\n{text}")
        total += float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    return total


def main():
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp()
    ec, ep = port(), port()
    start(["etcd", "--name", "bench", "--data-dir", f"{work}/etcd",
           "--listen-client-urls", f"http://127.0.0.1:{ec}",
           "--advertise-client-urls", f"http://127.0.0.1:{ec}",
           "--listen-peer-urls", f"http://127.0.0.1:{ep}",
           "--initial-advertise-peer-urls", f"http://127.0.0.1:{ep}",
           "--initial-cluster", f"bench=http://127.0.0.1:{ep}"], f"{work}/etcd.log")
    etcd = f"http://127.0.0.1:{ec}"
    wait_for("etcd", lambda: http("POST", etcd + "/v3/maintenance/status", {})[0] == 200)
    start([BIN, "backend", "--listen", "127.0.0.1:0"], f"{work}/backend.log")
    backend = announced(f"{work}/backend.log")

    fenced_reads = os.path.join(work, "fenced-reads.toml")
    open(fenced_reads, "w").write('[[fence.routes]]\npattern = "/kv/{lease}"\nfence_reads = true\n')
    members = {}
    for shards in (1, SHARDS):
        urls, pids = [], []
        for i in range(3):
            log = f"{work}/n{shards}-m{i}.log"
            p = start([BIN, "serve", "--listen", "127.0.0.1:0", "--upstream", backend,
                       "--etcd", etcd, "--name", f"m{i}"], log, {
                "FENCEGATE_LOG": "warn",
                "FENCEGATE_CLUSTER__PREFIX": f"/bench-{shards}/",
                "FENCEGATE_CLUSTER__SHARDS": str(shards),
                "FENCEGATE_CLUSTER__TTL_MS": str(TTL_MS),
                "FENCEGATE_CLUSTER__MARGIN_MS": "500",
                "FENCEGATE_LEASES__ACQUIRE_RATE_PER_CLIENT": "0",
                **({"FENCEGATE_CONFIG": fenced_reads} if shards > 1 else {}),
            })
            urls.append(announced(log))
            pids.append(p)
        owner = wait_for(f"{shards} shard(s) led", lambda: leaders(urls))
        if shards > 1:
            counts = [list(owner.values()).count(u) for u in urls]
            wait_for("balance", lambda: (lambda o: o and sorted(
                list(o.values()).count(u) for u in urls) == [4, 4, 4] and o)(leaders(urls)))
            owner = leaders(urls)
            counts = [list(owner.values()).count(u) for u in urls]
            print(f"12 shards: {counts} per member")
        members[shards] = (urls, pids, owner)

    acquire_lua = os.path.join(work, "acquire.lua")
    write_lua = os.path.join(work, "write.lua")
    open(acquire_lua, "w").write(WRK_ACQUIRE)
    open(write_lua, "w").write(WRK_WRITE)

    def targets(shards):
        """(url, shard count, owner map) per wrk process: one per member."""
        urls, _, owner = members[shards]
        n = shards
        return [(owner[0] if n == 1 else u, n, owner) for u in urls]

    def acquire_jobs(shards, rnd):
        jobs = []
        for i, (url, n, owner) in enumerate(targets(shards)):
            # More names than one process can acquire in a round.
            names = names_for(url, owner, 8000 * SECONDS, f"a{shards}-{rnd}-{i}", n)
            path = os.path.join(work, f"names-{shards}-{rnd}-{i}")
            open(path, "w").write("\n".join(names) + "\n")
            jobs.append((url, path))
        return jobs

    def write_jobs(shards, mixed=False):
        jobs = []
        for i, (url, n, owner) in enumerate(targets(shards)):
            # With `mixed`, leases of every shard through each member (what
            # clients without the shard map do).
            lease_owner = {k: url for k in owner} if mixed else owner
            names = names_for(url, lease_owner, 16, f"w{shards}-{i}-{int(mixed)}", n)
            lines = []
            for name in names:
                status, body = http("POST", f"{owner[shard_of(name, n)]}/_fence/leases/{name}",
                                    {"holder": "bench", "ttl_ms": 600000})
                if status != 201:
                    sys.exit(f"acquire {name}: {status} {body!r}")
                g = json.loads(body)
                lines.append(f"{name} {g['token']} {g['lease_id']}")
            path = os.path.join(work, f"terms-{shards}-{i}-{int(mixed)}")
            open(path, "w").write("\n".join(lines) + "\n")
            jobs.append((url, path))
        return jobs

    results = {("acquire", s): [] for s in (1, SHARDS)}
    results.update({("write", s): [] for s in (1, SHARDS)})
    writes = {s: write_jobs(s) for s in (1, SHARDS)}
    urls12 = members[SHARDS][0]
    forwarded_before = forwarded(urls12)
    for rnd in (1, 2, 3):
        for s in (1, SHARDS):
            results[("acquire", s)].append(wrk(work, acquire_lua, acquire_jobs(s, rnd)))
            results[("write", s)].append(wrk(work, write_lua, writes[s]))
        print(f"round {rnd}: acquires/s {results[('acquire', 1)][-1]:.0f} (1 shard) "
              f"{results[('acquire', SHARDS)][-1]:.0f} (12); fenced writes/s "
              f"{results[('write', 1)][-1]:.0f} (1) {results[('write', SHARDS)][-1]:.0f} (12)")
    sent12 = sum(results[("acquire", SHARDS)] + results[("write", SHARDS)]) * SECONDS
    share_map = (forwarded(urls12) - forwarded_before) / max(1.0, sent12)
    mixed_before = forwarded(urls12)
    mixed_rate = wrk(work, write_lua, write_jobs(SHARDS, mixed=True))
    share_mixed = (forwarded(urls12) - mixed_before) / max(1.0, mixed_rate * SECONDS)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"3 members, {CLIENTS} clients, {SECONDS}s rounds, medians of 3 alternating rounds:")
    for what in ("acquire", "write"):
        a, b = med[(what, 1)], med[(what, SHARDS)]
        label = "durable acquires/s" if what == "acquire" else "fenced writes/s"
        print(f"  {label}: 1 shard {a:.0f}, 12 shards {b:.0f} = {b / a:.2f}x")
    print(f"  forwarded between members: {100 * share_map:.1f} % of requests with the shard map; "
          f"{100 * share_mixed:.1f} % with leases of every shard through each member "
          f"({mixed_rate:.0f} writes/s)")

    urls, pids, owner = members[SHARDS]
    before, during = forwarded_slow_readers(urls, pids, owner)
    print(f"  200 slow readers of forwarded 1 MiB answers (8 pipelined GETs each, never read): "
          f"the forwarding member {before / 1048576:.1f} -> {during / 1048576:.1f} MiB resident, "
          f"{(during - before) / 1024 / 200:.1f} KiB each")

    # Failover: kill member 2; per shard it led, the time until a write
    # under a term held there is acknowledged through member 0.
    victim = urls[2]
    lost = sorted(k for k, u in owner.items() if u == victim)
    terms = {}
    for line in open(writes[SHARDS][2][1]):
        name, token, lease_id = line.split()
        terms.setdefault(shard_of(name, SHARDS), (name, token, lease_id))
    missing = [k for k in lost if k not in terms]
    for k in missing:
        name = names_for(victim, {k2: (victim if k2 == k else None) for k2 in owner}, 1, f"f{k}", SHARDS)[0]
        status, body = http("POST", f"{victim}/_fence/leases/{name}", {"holder": "bench", "ttl_ms": 600000})
        g = json.loads(body)
        terms[k] = (name, str(g["token"]), g["lease_id"])
    killed = time.time()
    pids[2].send_signal(signal.SIGKILL)
    took = {}
    while len(took) < len(lost) and time.time() - killed < 60:
        for k in lost:
            if k in took:
                continue
            name, token, lease_id = terms[k]
            status, _ = http("PUT", f"{urls[0]}/kv/{name}/k", None,
                             {"Fencing-Token": token, "Fencing-Lease-Id": lease_id}, timeout=2)
            if 200 <= status < 300:
                took[k] = (time.time() - killed) * 1000
        time.sleep(0.02)
    if len(took) < len(lost):
        sys.exit(f"shards {sorted(set(lost) - set(took))} never failed over")
    t = sorted(took.values())
    print(f"  failover of the {len(lost)} shards of a member killed with SIGKILL (TTL {TTL_MS} ms): "
          f"p50 {statistics.median(t):.0f} ms, max {t[-1]:.0f} ms")


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
