"""The lease API against the real binary: calls, problems as exceptions,
several members, and where a secret may go."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from conftest import Servers, advance

import fencegate


def test_acquire_renew_show_release(servers: Servers) -> None:
    fg = servers.fencegate()
    c = fencegate.Client(fg.url)
    g = c.acquire("orders", "A", ttl=5.0)
    assert (g.lease, g.holder, g.token, g.ttl) == ("orders", "A", 1, 5.0)
    assert len(g.lease_id) >= 32 and g.expires_in == 5.0
    advance(fg.url, 2000)
    r = c.renew("orders", g.token, g.lease_id)
    assert r.expires_in == 5.0 and r.lease_id == g.lease_id
    shown = c.show("orders")
    assert shown["state"] == "held" and shown["token"] == 1
    assert g.lease_id not in json.dumps(shown)
    assert [x["lease"] for x in c.show()["leases"]] == ["orders"]
    c.release("orders", g.token, g.lease_id)
    assert c.show("orders")["state"] == "released"


def test_problems_are_exceptions_with_their_reason(servers: Servers) -> None:
    fg = servers.fencegate()
    c = fencegate.Client(fg.url)
    a = c.acquire("orders", "A", ttl=5.0)
    with pytest.raises(fencegate.ProblemError) as held:
        c.acquire("orders", "B", ttl=5.0)
    assert held.value.status == 409 and held.value.reason == "lease-held"
    assert held.value.retry_after == 5.0 and held.value.body["holder"] == "A"
    advance(fg.url, 5000)
    b = c.acquire("orders", "B", ttl=5.0)
    with pytest.raises(fencegate.ProblemError) as stale:
        c.renew("orders", a.token, a.lease_id)
    assert stale.value.reason == "stale-fencing-token" and stale.value.status == 412
    with pytest.raises(fencegate.ProblemError) as bad:
        c.acquire("no spaces", "A", ttl=5.0)
    assert bad.value.reason == "invalid-lease-name"
    c.release("orders", b.token, b.lease_id)


def test_an_acquire_waits_for_the_lease(servers: Servers) -> None:
    fg = servers.fencegate(manual=False)
    c = fencegate.Client(fg.url)
    a = c.acquire("orders", "A", ttl=5.0)
    releaser = threading.Timer(0.3, c.release, ("orders", a.token, a.lease_id))
    releaser.start()
    b = c.acquire("orders", "B", ttl=5.0, wait=10.0)
    releaser.join()
    assert b.token == 2


def test_a_refused_member_is_skipped(servers: Servers) -> None:
    fg = servers.fencegate()
    # Nothing listens on port 1.
    c = fencegate.Client(f"http://127.0.0.1:1,{fg.url}")
    assert c.acquire("orders", "A", ttl=5.0).token == 1
    with pytest.raises(fencegate.Unreachable):
        fencegate.Client("http://127.0.0.1:1", timeout=2.0).acquire("x", "A", ttl=5.0)


class _Member(http.server.BaseHTTPRequestHandler):
    """A programmable member: `answer(handler) -> (status, doc)`; counts
    what it was asked."""

    hits: ClassVar[list[str]]
    answer: ClassVar[Any]

    def _any(self) -> None:
        type(self).hits.append(f"{self.command} {self.path}")
        status, doc = type(self).answer(self)
        body = json.dumps(doc).encode()
        self.send_response(status)
        kind = "application/problem+json" if status >= 400 else "application/json"
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _any

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def member(answer: Any) -> Iterator[tuple[str, type[_Member]]]:
    class M(_Member):
        hits: ClassVar[list[str]] = []

    M.answer = staticmethod(answer)
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), M)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{s.server_address[1]}", M
    finally:
        s.shutdown()
        s.server_close()


def not_primary(named: str | None) -> tuple[int, dict[str, Any]]:
    return 503, {"reason": "not-primary", "status": 503, "primary": named}


GRANT = {"lease": "orders", "holder": "A", "token": 3, "lease_id": "ab" * 16}


def test_a_routed_call_follows_the_primary_its_shard_s_leader_names() -> None:
    # A's map names B as every shard's leader; B has just lost the shards
    # to C and says so: the next attempt goes to C, not to B again.
    granted = {**GRANT, "ttl_ms": 5000, "expires_in_ms": 5000}
    with member(lambda h: (201, granted)) as (c, cm), member(lambda h: not_primary(c)) as (b, bm):

        def a_answer(h: Any) -> tuple[int, dict[str, Any]]:
            if h.path == "/_fence/cluster":
                return 200, {"shards": 2, "leaders": [{"primary": {"url": b}}] * 2}
            return not_primary(b)

        with member(a_answer) as (a, _):
            g = fencegate.Client(f"{a},{b},{c}").acquire("orders", "A", ttl=5.0)
    assert g.token == 3
    assert bm.hits == ["POST /_fence/leases/orders"]
    assert cm.hits == ["POST /_fence/leases/orders"]


def test_a_call_with_a_budget_stops_trying_when_it_is_spent() -> None:
    left = [10.0]
    with member(lambda h: not_primary(None)) as (url, m):
        t = fencegate.Client(url).transport

        def budget() -> float:
            # Spent after the third attempt.
            if len(m.hits) >= 3:
                left[0] = 0.0
            return left[0]

        reply = t.call("POST", "/_fence/leases/orders/renew", lease="orders", budget=budget)
    assert reply.status == 503 and len(m.hits) == 3


def test_environment_proxies_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = {"leases": [], "next": None}
    with member(lambda h: (200, {})) as (proxy, pm), member(lambda h: (200, listing)) as (url, m):
        for var in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(var, proxy)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        fencegate.Client(url, token="s3cret").show()
    assert pm.hits == [] and m.hits == ["GET /_fence/leases"]


def test_a_secret_or_lease_id_never_goes_to_a_url_it_was_not_given(servers: Servers) -> None:
    fg = servers.fencegate()

    # A standby that names (as primary, and as every shard's leader) a
    # member nobody listed: calls go on to the listed ones instead.
    def standby_of(elsewhere: str) -> Any:
        def answer(h: Any) -> tuple[int, dict[str, Any]]:
            if h.path == "/_fence/cluster":
                return 200, {"shards": 2, "leaders": [{"primary": {"url": elsewhere}}] * 2}
            return not_primary(elsewhere)

        return answer

    with member(lambda h: (200, {})) as (elsewhere, unlisted):
        headers: list[dict[str, str]] = []
        with member(_recording(headers, standby_of(elsewhere))) as (standby, _):
            c = fencegate.Client(f"{standby},{fg.url}", token="s3cret")
            g = c.acquire("orders", "A", ttl=5.0)
            c.renew("orders", g.token, g.lease_id)
            c.release("orders", g.token, g.lease_id)
            assert c.member_for("orders") in (standby, fg.url)
        assert headers and all(h.get("Authorization") == "Bearer s3cret" for h in headers)
    assert unlisted.hits == [], "a member nobody listed was sent a call"


def _recording(seen: list[dict[str, str]], answer: Any) -> Any:
    def recorded(h: Any) -> Any:
        seen.append(dict(h.headers))
        return answer(h)

    return recorded
