"""The lease API: acquire, renew, release, show, and holding a term."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ._transport import FENCING_LEASE_ID, FENCING_TOKEN, Transport, problem
from .term import AsyncTerm, Term


@dataclass(frozen=True)
class Grant:
    """A term as fencegate granted or renewed it. Times are seconds, and
    relative (``expires_in``): clients never compare wall clocks with the
    proxy."""

    lease: str
    holder: str
    token: int
    lease_id: str
    ttl: float
    expires_in: float

    @classmethod
    def _from(cls, doc: dict[str, Any], lease_id: str = "") -> Grant:
        return cls(
            lease=str(doc["lease"]),
            holder=str(doc.get("holder", "")),
            token=int(doc["token"]),
            lease_id=str(doc.get("lease_id") or lease_id),
            ttl=int(doc["ttl_ms"]) / 1000.0,
            expires_in=int(doc["expires_in_ms"]) / 1000.0,
        )


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


class Client:
    """A client of one fencegate, or of the members of a cluster
    (``"http://a:8080,http://b:8080,http://c:8080"``: calls follow the
    primary, and with shards go to the primary of each lease's shard).

    ``token``: the bearer secret, for a fencegate with authentication on;
    ``cafile``: CA certificates (PEM) for ``https://`` members with a
    private CA; ``timeout``: seconds each call may take.
    """

    def __init__(
        self,
        servers: str = "http://127.0.0.1:8080",
        *,
        token: str | None = None,
        cafile: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._t = Transport(servers, token=token, cafile=cafile, timeout=timeout)

    @property
    def transport(self) -> Transport:
        return self._t

    def member_for(self, lease: str) -> str:
        """The listed URL that serves ``lease`` now: its shard's primary when
        the cluster has shards and the map names one, else the member calls
        go to. Send a lease's writes there to spare a hop (or where
        members do not forward)."""
        return self._t.member_for(lease)

    def _lease_path(self, lease: str, rest: str = "") -> str:
        return f"/_fence/leases/{quote(lease, safe='')}{rest}"

    def acquire(self, lease: str, holder: str, ttl: float, wait: float = 0.0) -> Grant:
        """A term of ``lease`` for ``holder``, ``ttl`` seconds long; waits up
        to ``wait`` seconds for a held lease to come free. Raises
        :class:`~fencegate.ProblemError` (``lease-held`` with
        ``retry_after``, ...)."""
        body: dict[str, Any] = {"holder": holder, "ttl_ms": _ms(ttl)}
        if wait > 0:
            body["wait_ms"] = _ms(wait)
        reply = self._t.call(
            "POST",
            self._lease_path(lease),
            lease=lease,
            headers={"Content-Type": "application/json"},
            body=json.dumps(body).encode(),
            timeout=self._t.timeout + wait,
        )
        if reply.status != 201:
            raise problem(reply)
        return Grant._from(reply.json())

    def renew(
        self,
        lease: str,
        token: int,
        lease_id: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        budget: Callable[[], float] | None = None,
    ) -> Grant:
        """Moves the term's deadline to now plus its TTL (or ``ttl``).
        ``timeout`` bounds each try (default: the client's); ``budget``, if
        given, says how many seconds are left for all of them (a term's
        renewer gives up at its local deadline, whichever member it
        tries)."""
        body = json.dumps({"ttl_ms": _ms(ttl)}).encode() if ttl is not None else None
        headers = {FENCING_TOKEN: str(token), FENCING_LEASE_ID: lease_id}
        if body is not None:
            headers["Content-Type"] = "application/json"
        reply = self._t.call(
            "POST",
            self._lease_path(lease, "/renew"),
            lease=lease,
            headers=headers,
            body=body,
            timeout=timeout,
            budget=budget,
        )
        if reply.status != 200:
            raise problem(reply)
        return Grant._from(reply.json(), lease_id)

    def release(self, lease: str, token: int, lease_id: str) -> None:
        """Ends the term at once (the next holder can start)."""
        reply = self._t.call(
            "DELETE",
            self._lease_path(lease),
            lease=lease,
            headers={FENCING_TOKEN: str(token), FENCING_LEASE_ID: lease_id},
        )
        if reply.status != 204:
            raise problem(reply)

    def show(self, lease: str | None = None) -> Any:
        """One lease as fencegate shows it (never its lease id), or, with no
        name, the first page of the listing."""
        path = self._lease_path(lease) if lease is not None else "/_fence/leases"
        reply = self._t.call("GET", path, lease=lease)
        if reply.status != 200:
            raise problem(reply)
        return reply.json()

    def hold(
        self,
        lease: str,
        holder: str,
        ttl: float,
        wait: float = 0.0,
        *,
        margin: float | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> Term:
        """A term of ``lease``, acquired when a ``with`` block is entered
        (or by :meth:`Term.acquire`) and then renewed in a background thread
        until released, as leaving the block does. See
        :class:`~fencegate.Term`."""
        return Term(self, lease, holder, ttl, wait, margin, on_lost)

    def hold_async(
        self,
        lease: str,
        holder: str,
        ttl: float,
        wait: float = 0.0,
        *,
        margin: float | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> AsyncTerm:
        """:meth:`hold` for asyncio: ``async with client.hold_async(...) as
        term``; the renewer is a task on the running loop."""
        return AsyncTerm(self, lease, holder, ttl, wait, margin, on_lost)
