"""Fencing requests: ``session(term)``.

::

    http = fencegate.requests.session(term)
    http.put(f"{FENCEGATE}/dav/orders/42", data=b"shipped")

A :class:`requests.Session` whose writes (every method but GET, HEAD,
OPTIONS and PROPFIND) carry the term's fencing headers, raise
:class:`~fencegate.LeaseLost` instead of sending once the term is lost, and
on ``428 precondition-required`` (a route with storage-side preconditions
whose key fencegate has not seen) read the key once (``HEAD``) and send the
write again. A body given as a file or a generator cannot be sent twice:
give bytes.
"""

from __future__ import annotations

from typing import Any, Union

import requests as _requests

from .term import AsyncTerm, Term

_READS = frozenset({"GET", "HEAD", "OPTIONS", "PROPFIND"})


class FencedSession(_requests.Session):
    """A session whose writes are fenced under ``term``."""

    def __init__(self, term: Union[Term, AsyncTerm]) -> None:
        super().__init__()
        self.term = term

    def request(  # type: ignore[override]
        self, method: str, url: Union[str, bytes], *args: Any, **kwargs: Any
    ) -> _requests.Response:
        if method.upper() in _READS:
            return super().request(method, url, *args, **kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(self.term.headers())
        answer = super().request(method, url, *args, headers=headers, **kwargs)
        if answer.status_code == 428 and _reason(answer) == "precondition-required":
            super().request("HEAD", url)
            headers.update(self.term.headers())
            answer = super().request(method, url, *args, headers=headers, **kwargs)
        return answer


def _reason(answer: _requests.Response) -> Any:
    if not answer.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        return answer.json().get("reason")
    except ValueError:
        return None


def session(term: Union[Term, AsyncTerm]) -> FencedSession:
    """A new :class:`FencedSession` under ``term``."""
    return FencedSession(term)
