"""Three members with twelve shards, sharing lease state through etcd, that
do not forward: the client sends each lease's calls to its shard's primary
from the shard map, and a term outlives the death of the member that
granted it."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from conftest import Server, Servers, free_port, raw

import fencegate
import fencegate.requests
from fencegate._transport import Reply, shard_of

SHARDS = 12


def view(url: str) -> Any:
    try:
        with urllib.request.urlopen(f"{url}/_fence/cluster", timeout=2) as r:
            return json.load(r)
    except OSError:
        return None


def settled(urls: list[str], within: float = 60.0) -> list[str]:
    """Waits (real time, bounded: etcd sessions and handovers) until every
    member names the same primary for every shard, each member leading its
    share; their URLs."""
    limit = time.monotonic() + within
    while True:
        views = [view(u) for u in urls]
        leaders = [
            [
                ((entry or {}).get("primary") or {}).get("url")
                for entry in (v or {}).get("leaders", [])
            ]
            for v in views
        ]
        if all(ls == leaders[0] for ls in leaders) and len(leaders[0]) == SHARDS:
            share = -(-SHARDS // len(urls))
            if all(leaders[0].count(u) == share for u in urls):
                return leaders[0]
        assert time.monotonic() < limit, f"shards not settled: {views}"
        time.sleep(0.1)


def one_lease_per_shard() -> list[str]:
    names: dict[int, str] = {}
    n = 0
    while len(names) < SHARDS:
        names.setdefault(shard_of(f"lease-{n}", SHARDS), f"lease-{n}")
        n += 1
    return [names[k] for k in range(SHARDS)]


def cluster(servers: Servers) -> list[Server]:
    etcd = servers.etcd()
    backend = servers.backend()
    env = {
        "FENCEGATE_CLUSTER__SHARDS": str(SHARDS),
        "FENCEGATE_CLUSTER__FORWARD": "false",
        "FENCEGATE_CLUSTER__TTL_MS": "3000",
        "FENCEGATE_CLUSTER__MARGIN_MS": "500",
    }
    return [
        servers.fencegate(
            "--upstream",
            backend.url,
            "--etcd",
            etcd.url,
            "--name",
            f"m{i}",
            manual=False,
            name=f"m{i}",
            listen=f"127.0.0.1:{free_port()}",
            env=env,
        )
        for i in range(3)
    ]


def test_calls_go_to_each_lease_s_shard_primary(servers: Servers) -> None:
    members = cluster(servers)
    urls = [m.url for m in members]
    leaders = settled(urls)
    client = fencegate.Client(",".join(urls))
    answers: list[tuple[str, str, int]] = []
    send = client.transport._send

    def recorded(base: str, method: str, path: str, *args: Any) -> Reply:
        reply = send(base, method, path, *args)
        answers.append((base, path, reply.status))
        return reply

    client.transport._send = recorded  # type: ignore[method-assign]
    for name in one_lease_per_shard():
        with client.hold(name, holder="w", ttl=20.0) as term:
            http = fencegate.requests.session(term)
            primary = leaders[shard_of(name, SHARDS)]
            assert client.member_for(name) == primary
            put = http.put(f"{client.member_for(name)}/kv/{name}/k", data=b"v")
            assert put.status_code == 201, put.text
            client.renew(name, term.token, term.lease_id)
        path = f"/_fence/leases/{name}"
        lease_calls = [(b, s) for b, p, s in answers if p in (path, f"{path}/renew")]
        # acquire, renew, release: each straight to the primary.
        assert lease_calls == [(primary, 201), (primary, 200), (primary, 204)], lease_calls
    assert all(s != 503 for _, _, s in answers), answers


def test_a_term_outlives_the_member_that_granted_it(servers: Servers) -> None:
    members = cluster(servers)
    urls = [m.url for m in members]
    leaders = settled(urls)
    client = fencegate.Client(",".join(urls))
    name = "orders"
    first = leaders[shard_of(name, SHARDS)]
    with client.hold(name, holder="w", ttl=20.0) as term:
        http = fencegate.requests.session(term)
        assert http.put(f"{first}/kv/{name}/k", data=b"v1").status_code == 201
        killed = time.monotonic()
        next(m for m in members if m.url == first).stop()
        # Real time, bounded: the shard's new primary takes over within a
        # few cluster TTLs (3 s), and the renewer (every 6.7 s) follows it.
        # The local deadline is 18 s after the last renewal: wide margin.
        # A renewal sent after the kill moves it past killed + 18 s.
        limit = killed + 60
        while term._schedule.deadline <= killed + 18.0:
            term.check()
            assert time.monotonic() < limit, "no renewal after the kill"
            time.sleep(0.1)
        now = client.member_for(name)
        assert now != first
        put = http.put(f"{now}/kv/{name}/k", data=b"v2")
        assert put.status_code == 204, put.text
        assert client.show(name)["token"] == term.token == 1
    assert raw("GET", f"{now}/kv/{name}/k")[1] == b"v2"
