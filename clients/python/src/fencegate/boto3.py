"""Fencing boto3: ``fence(s3, term)``.

::

    s3 = fencegate.boto3.fence(boto3.client("s3", endpoint_url=FENCEGATE), term)
    s3.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"shipped")

Every write the client sends (any method but GET and HEAD) carries the
term's fencing headers, added after SigV4 has signed it (the
``before-send`` event), so they are not among the signed headers; once the
term is lost, :class:`~fencegate.LeaseLost` is raised instead of sending a
write. Reads pass as they are. A write that
fencegate answers ``428 precondition-required`` (a route with storage-side
preconditions whose key it has not seen) makes it read the key once
(``head_object``) and send the write again.
"""

from __future__ import annotations

import json
from typing import Any

from .term import AsyncTerm, Term

_PARAMS = "fencegate_params"
_READ = "fencegate_read_first"
_READS = frozenset({"GET", "HEAD"})


def fence(client: Any, term: Term | AsyncTerm) -> Any:
    """Fences every write of ``client`` (a boto3 S3 client) under
    ``term``; returns ``client``. Requires path-style addressing, as any S3
    client in front of fencegate does."""
    events = client.meta.events

    def keep_params(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context[_PARAMS] = {k: params[k] for k in ("Bucket", "Key") if k in params}

    def add_headers(request: Any, **_: Any) -> None:
        if request.method in _READS:
            return
        for name, value in term.headers().items():
            request.headers[name] = value

    def read_first(response: Any, request_dict: dict[str, Any], **_: Any) -> Any:
        if response is None:
            return None
        http = response[0]
        if http.status_code != 428:
            return None
        try:
            reason = json.loads(http.content).get("reason")
        except (ValueError, AttributeError):
            return None
        context = request_dict.get("context") or {}
        params = context.get(_PARAMS) or {}
        if reason != "precondition-required" or context.get(_READ):
            return None
        if "Bucket" not in params or "Key" not in params:
            return None
        context[_READ] = True
        try:
            client.head_object(Bucket=params["Bucket"], Key=params["Key"])
        except client.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                return None
        return 0  # send it again, at once

    events.register("before-parameter-build.s3", keep_params)
    events.register("before-send.s3", add_headers)
    events.register_first("needs-retry.s3", read_first)
    return client
