"""Fencing boto3: ``fence(s3, term)``, ``fence(dynamodb, term)``.

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

A DynamoDB client (or a resource: its ``meta.client``) gets more, since
SigV4 signs the body fencegate must not change: before the request is
built (the ``before-parameter-build`` event, ahead of signing) each
``PutItem``, ``UpdateItem`` and each ``Put`` and ``Update`` of a
``TransactWriteItems`` gets the term's token in the item's token attribute
and the condition that makes DynamoDB refuse it once a later term wrote
the item (SPEC section 11)::

    dynamodb = fencegate.boto3.fence(boto3.client("dynamodb", endpoint_url=FENCEGATE), term)
    dynamodb.put_item(TableName="jobs", Item={"pk": {"S": "orders/42"}, ...})
    # DynamoDB refuses a late one with ConditionalCheckFailedException.

Your own ``ConditionExpression`` is kept, ANDed with fencegate's; your own
``UpdateExpression`` gets one more ``SET`` action. ``DeleteItem`` and
``BatchWriteItem`` cannot be fenced by DynamoDB (a deleted item keeps no
token; a batch takes no condition): fencegate refuses them with 428.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .term import AsyncTerm, Term

_PARAMS = "fencegate_params"
_READ = "fencegate_read_first"
_READS = frozenset({"GET", "HEAD"})


_NAME = "#fencegate_token"
_VALUE = ":fencegate_token"
_CONDITION = "attribute_not_exists(#fencegate_token) OR #fencegate_token <= :fencegate_token"
_SET = "#fencegate_token = :fencegate_token"
_DYNAMODB_WRITES = frozenset(
    {"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems"}
)
# The SET clause's keyword: not a placeholder (`#set`, `:set`) nor part of
# a name.
_SET_CLAUSE = re.compile(r"(?<![#:\w])SET(?!\w)", re.IGNORECASE)


def _carry_token(write: dict[str, Any], token: int, attribute: str, put: bool) -> None:
    """Adds the token and its condition to one item write (a ``PutItem``'s
    or ``UpdateItem``'s parameters, or a transaction's ``Put`` or
    ``Update``), in DynamoDB's JSON."""
    if "Expected" in write or "AttributeUpdates" in write or "ConditionalOperator" in write:
        raise ValueError(
            "fencegate conditions the write with an expression: use ConditionExpression "
            "and UpdateExpression, not Expected, AttributeUpdates or ConditionalOperator"
        )
    number = {"N": str(token)}
    write["ExpressionAttributeNames"] = {
        **write.get("ExpressionAttributeNames", {}),
        _NAME: attribute,
    }
    write["ExpressionAttributeValues"] = {
        **write.get("ExpressionAttributeValues", {}),
        _VALUE: number,
    }
    own = write.get("ConditionExpression")
    write["ConditionExpression"] = f"({own}) AND ({_CONDITION})" if own else _CONDITION
    if put:
        write["Item"] = {**write.get("Item", {}), attribute: number}
        return
    update = write.get("UpdateExpression", "")
    if _SET_CLAUSE.search(update):
        write["UpdateExpression"] = _SET_CLAUSE.sub(f"SET {_SET},", update, count=1)
    else:
        write["UpdateExpression"] = f"{update} SET {_SET}".strip()


def _fence_dynamodb(term: Term | AsyncTerm, token_attribute: str) -> Callable[..., None]:
    """The ``before-parameter-build`` hook that adds ``term``'s token and
    its condition to each item write."""

    def add_token(params: dict[str, Any], model: Any, **_: Any) -> None:
        name = model.name
        if name not in ("PutItem", "UpdateItem", "TransactWriteItems"):
            return
        term.headers()  # raises LeaseLost once the term is lost
        token = term.token
        if name == "TransactWriteItems":
            # Copies: the caller's own items stay as they were, so that the
            # same list can be sent again.
            items = []
            for item in params.get("TransactItems", []):
                item = dict(item)
                for kind in ("Put", "Update"):
                    if kind in item:
                        item[kind] = dict(item[kind])
                        _carry_token(item[kind], token, token_attribute, put=kind == "Put")
                items.append(item)
            params["TransactItems"] = items
            return
        _carry_token(params, token, token_attribute, put=name == "PutItem")

    return add_token


def fence(client: Any, term: Term | AsyncTerm, token_attribute: str = "fencing_token") -> Any:
    """Fences every write of ``client`` (a boto3 S3 or DynamoDB client, or
    a resource) under ``term``. An S3 client needs
    path-style addressing, as any S3 client in front of fencegate does; a
    DynamoDB client's items keep the token in ``token_attribute`` (the
    route's). The hooks go when the term is released: the client may then
    be fenced under the next term. Returns what it was given."""
    given = client
    if not hasattr(client.meta, "events"):  # a resource
        client = client.meta.client
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

    def add_dynamodb_headers(request: Any, **_: Any) -> None:
        # Every DynamoDB call is a POST: the operation says what writes.
        target = request.headers.get("X-Amz-Target", b"")
        if isinstance(target, bytes):
            target = target.decode("ascii", "replace")
        if target.rpartition(".")[2] not in _DYNAMODB_WRITES:
            return
        for name, value in term.headers().items():
            request.headers[name] = value

    hooks: list[tuple[str, Callable[..., Any]]]
    if client.meta.service_model.service_name == "dynamodb":
        hooks = [
            ("before-parameter-build.dynamodb", _fence_dynamodb(term, token_attribute)),
            ("before-send.dynamodb", add_dynamodb_headers),
        ]
        for event, hook in hooks:
            events.register(event, hook)
    else:
        hooks = [
            ("before-parameter-build.s3", keep_params),
            ("before-send.s3", add_headers),
            ("needs-retry.s3", read_first),
        ]
        events.register("before-parameter-build.s3", keep_params)
        events.register("before-send.s3", add_headers)
        events.register_first("needs-retry.s3", read_first)

    def unregister() -> None:
        for event, hook in hooks:
            events.unregister(event, hook)

    term.on_release(unregister)
    return given
