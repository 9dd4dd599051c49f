"""HTTP to fencegate: one or several members, the shard map, the primary.

Standard library only (``urllib``). Every call has a timeout. A call goes
only to URLs the caller listed: an answer naming any other URL is not
followed, redirects are not followed, and environment proxies
(``http_proxy``) are not used, so the bearer secret and lease ids never
leave for a place the caller did not name.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ProblemError, Unreachable

#: Header names of the fencing credentials.
FENCING_TOKEN = "Fencing-Token"
FENCING_LEASE_ID = "Fencing-Lease-Id"


def shard_of(name: str, shards: int) -> int:
    """The shard of lease ``name``: the first eight bytes of SHA-256 of the
    name, big-endian, modulo the number of shards (as the README gives)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % shards


@dataclass
class Reply:
    """An answer, read in full."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class _Refused(Exception):
    """The connection was refused: nothing was sent."""


def _opener() -> urllib.request.OpenerDirector:
    """Follows no redirect and uses no proxy."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), NoRedirect)


class Transport:
    """The members of one fencegate (``"http://a,http://b"``) and how to
    reach them: a bearer secret, a CA file for ``https://``, a timeout."""

    def __init__(
        self,
        servers: str,
        *,
        token: str | None = None,
        cafile: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.members = [s.strip().rstrip("/") for s in servers.split(",") if s.strip()]
        if not self.members:
            raise ValueError("no fencegate URL given")
        for m in self.members:
            if not (m.startswith("http://") or m.startswith("https://")):
                raise ValueError(f"{m!r}: give an http:// or https:// URL")
        self.timeout = timeout
        self._token = token
        self._ssl = ssl.create_default_context(cafile=cafile)
        self._opener = _opener()
        self._lock = threading.Lock()
        self._current = self.members[0]
        # The shard map: leaders[k] is the listed URL of shard k's primary.
        self._shards = 1
        self._leaders: list[str | None] = []
        self._map_stale = True

    # -- one request ------------------------------------------------------

    def _send(
        self,
        base: str,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        timeout: float,
    ) -> Reply:
        req = urllib.request.Request(base + path, data=body, method=method)
        for k, v in headers.items():
            req.add_header(k, v)
        if self._token is not None and "Authorization" not in headers:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            kwargs: dict[str, Any] = {"timeout": timeout}
            if base.startswith("https://"):
                kwargs["context"] = self._ssl
            with self._opener.open(req, **kwargs) as r:
                return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as e:
            reply = Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())
            e.close()
            return reply
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                raise _Refused() from e
            raise Unreachable(f"{base}: {e.reason}") from e
        except TimeoutError as e:
            raise Unreachable(f"{base}: no answer within {timeout:.1f} s") from e
        except OSError as e:
            raise Unreachable(f"{base}: {e}") from e

    # -- where calls go ---------------------------------------------------

    def _route(self, lease: str | None) -> str | None:
        with self._lock:
            if lease is None or self._shards < 2:
                return None
            return self._leaders[shard_of(lease, self._shards)]

    def _refresh_map(self) -> None:
        if not self._map_stale or len(self.members) < 2:
            return
        base = self.current()
        try:
            reply = self._send(base, "GET", "/_fence/cluster", {}, None, min(self.timeout, 2.0))
        except (_Refused, Unreachable):
            return
        doc = reply.json() if reply.status == 200 else None
        shards, leaders = 1, []
        if isinstance(doc, dict) and isinstance(doc.get("leaders"), list):
            n = int(doc.get("shards") or 1)
            if n > 1 and len(doc["leaders"]) == n:
                for entry in doc["leaders"]:
                    url = ((entry or {}).get("primary") or {}).get("url")
                    url = url.rstrip("/") if isinstance(url, str) else None
                    leaders.append(url if url in self.members else None)
                shards = n
        with self._lock:
            self._shards, self._leaders = shards, leaders
            self._map_stale = reply.status not in (200, 404)

    def member_for(self, lease: str) -> str:
        """The listed URL that serves ``lease`` now."""
        self._refresh_map()
        return self._route(lease) or self.current()

    def current(self) -> str:
        with self._lock:
            return self._current

    def _move_on(self, failed: str, primary: str | None) -> None:
        with self._lock:
            if self._current != failed:
                return
            if primary is not None and primary != failed:
                self._current = primary
            else:
                i = self.members.index(failed) if failed in self.members else -1
                self._current = self.members[(i + 1) % len(self.members)]

    def call(
        self,
        method: str,
        path: str,
        *,
        lease: str | None = None,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        timeout: float | None = None,
        budget: Callable[[], float] | None = None,
    ) -> Reply:
        """One request, sent to the primary of ``lease``'s shard (or the
        member calls go to now), moved to another listed member only on an
        answer that proves nothing was done: ``503 not-primary`` (to the
        primary it names, if listed) or a refused connection. At most 40
        attempts; with ``budget`` (the seconds left, asked before each
        attempt), none once it is spent, and none longer than it."""
        timeout = self.timeout if timeout is None else timeout
        headers = dict(headers or {})
        refused: list[str] = []
        moves = 0
        last: Reply | None = None
        named: str | None = None
        while True:
            attempt = timeout
            if budget is not None:
                left = budget()
                if left <= 0:
                    if last is not None:
                        return last
                    raise Unreachable("no member served the call before its deadline")
                attempt = min(timeout, left)
            self._refresh_map()
            routed = self._route(lease)
            if named is not None and named not in refused:
                base = named
            elif routed is not None and routed not in refused:
                base = routed
            else:
                base = self.current()
            primary: str | None = None
            try:
                reply = self._send(base, method, path, headers, body, attempt)
            except _Refused as e:
                if base not in refused:
                    refused.append(base)
                with self._lock:
                    self._map_stale = True
                if len(refused) >= len(self.members):
                    raise Unreachable(f"every member refused the connection: {self.members}") from e
            else:
                if reply.status == 503 and _reason(reply) == "not-primary":
                    last = reply
                    with self._lock:
                        self._map_stale = True
                    said = (reply.json() or {}).get("primary")
                    if isinstance(said, str) and said.rstrip("/") in self.members:
                        primary = said.rstrip("/")
                else:
                    if "fencegate-forwarded" in reply.headers:
                        with self._lock:
                            self._map_stale = True
                    with self._lock:
                        if base in self.members:
                            self._current = base
                    return reply
            moves += 1
            if moves >= 40:
                if last is not None:
                    return last
                raise Unreachable(f"no member served the call: {self.members}")
            # A round of every member, or a named primary that is not (yet)
            # one: a pause, so a cluster between primaries is not flooded.
            if moves % len(self.members) == 0 or (primary is not None and primary == named):
                pause = 0.25 if budget is None else min(0.25, max(0.0, budget()))
                time.sleep(pause)
            named = primary
            self._move_on(base, primary)


def _reason(reply: Reply) -> str | None:
    if not reply.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        doc = reply.json()
    except ValueError:
        return None
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) else None


def problem(reply: Reply) -> ProblemError:
    """The problem document of a failed answer, as an exception."""
    try:
        doc = reply.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        doc = {}
    retry = reply.headers.get("retry-after")
    try:
        retry_after: float | None = float(retry) if retry is not None else None
    except ValueError:
        retry_after = None
    return ProblemError(
        reply.status,
        str(doc.get("reason") or f"http-{reply.status}"),
        str(doc.get("detail") or reply.body[:200].decode("utf-8", "replace")),
        retry_after,
        doc,
    )
