"""Fencing requests: ``session(term)``.

::

    http = fencegate.requests.session(term)
    http.put(f"{FENCEGATE}/dav/orders/42", data=b"shipped")

A :class:`requests.Session` whose writes (every method but GET, HEAD,
OPTIONS and PROPFIND) carry the term's fencing headers, raise
:class:`~fencegate.LeaseLost` instead of sending once the term is lost, and
on ``428 precondition-required`` (a route with storage-side preconditions
whose key fencegate has not seen) read the key once (``HEAD``, with the
request's parameters, auth and timeout) and send the write again. A body
that is a file is sent again from where it started; one from a generator
cannot be, and the 428 is returned as it is. A redirect to another host
drops the fencing headers, as requests drops ``Authorization``.
"""

from __future__ import annotations

from typing import Any

import requests as _requests

from ._transport import FENCING_LEASE_ID, FENCING_TOKEN
from .term import AsyncTerm, Term

_READS = frozenset({"GET", "HEAD", "OPTIONS", "PROPFIND"})


class FencedSession(_requests.Session):
    """A session whose writes are fenced under ``term``."""

    def __init__(self, term: Term | AsyncTerm) -> None:
        super().__init__()
        self.term = term

    def request(  # type: ignore[override]
        self, method: str, url: str | bytes, **kwargs: Any
    ) -> _requests.Response:
        if method.upper() in _READS:
            return super().request(method, url, **kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(self.term.headers())
        kwargs["headers"] = headers
        data = kwargs.get("data")
        start = _position(data)
        answer = super().request(method, url, **kwargs)
        if answer.status_code != 428 or _reason(answer) != "precondition-required":
            return answer
        if data is not None and not isinstance(data, (bytes, str, dict, list, tuple)):
            if start is None:
                return answer  # a generator's body is spent: not sent again
            data.seek(start)
        read = {k: kwargs[k] for k in _READ_ALONG if k in kwargs}
        super().request("HEAD", url, **read)
        headers.update(self.term.headers())
        return super().request(method, url, **kwargs)

    def rebuild_auth(self, prepared_request: Any, response: Any) -> None:
        super().rebuild_auth(prepared_request, response)  # type: ignore[no-untyped-call]
        if self.should_strip_auth(  # type: ignore[no-untyped-call]
            response.request.url, prepared_request.url
        ):
            for name in (FENCING_TOKEN, FENCING_LEASE_ID):
                prepared_request.headers.pop(name, None)


#: What the read before a write again keeps of the write's arguments.
_READ_ALONG = ("params", "auth", "timeout", "verify", "cert", "cookies", "proxies")


def _position(data: Any) -> int | None:
    """Where a file-like body starts, or ``None`` if it cannot be rewound."""
    seek, tell = getattr(data, "seek", None), getattr(data, "tell", None)
    if seek is None or tell is None:
        return None
    try:
        return int(tell())
    except (OSError, ValueError):
        return None


def _reason(answer: _requests.Response) -> Any:
    if not answer.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        return answer.json().get("reason")
    except ValueError:
        return None


def session(term: Term | AsyncTerm) -> FencedSession:
    """A new :class:`FencedSession` under ``term``."""
    return FencedSession(term)
