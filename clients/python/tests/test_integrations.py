"""boto3 and requests fenced under a term, against the real binary in front
of moto's S3 server, nginx's WebDAV, and its embedded store: the fencing
headers on every write, LeaseLost instead of sending once lost, the zombie's
write refused, and the 428 path (read once, send again)."""

from __future__ import annotations

import contextlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import boto3
import botocore.config
import pytest
from conftest import Server, Servers, advance, raw
from test_term import ManualClock

import fencegate
import fencegate.boto3
import fencegate.requests
from fencegate.term import Term

S3_CONFIG = """
upstream = "{upstream}"
[proxy]
preserve_host = true
[[fence.routes]]
pattern = "/orders-bucket/{{lease}}"
preconditions = "etag"
"""


def s3_client(url: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=botocore.config.Config(
            s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 1}
        ),
    )


def sent(s3: Any) -> list[str]:
    """Records each request `s3` sends: 'METHOD path'."""
    log: list[str] = []

    def record(request: Any, **_: Any) -> None:
        path = request.url.split("://", 1)[1].split("/", 1)[1].split("?", 1)[0]
        log.append(f"{request.method} /{path}")

    s3.meta.events.register("before-send.s3", record)
    return log


@pytest.fixture
def s3(servers: Servers) -> Iterator[tuple[Server, Server]]:
    moto = servers.moto()
    s3_client(moto.url).create_bucket(Bucket="orders-bucket")
    fg = servers.fencegate(config=S3_CONFIG.format(upstream=moto.url))
    yield fg, moto


def test_boto3_writes_carry_the_term_and_a_new_key_is_read_once(
    s3: tuple[Server, Server],
) -> None:
    fg, moto = s3
    client = fencegate.Client(fg.url)
    with client.hold("orders", holder="w1", ttl=30.0) as term:
        s3c = fencegate.boto3.fence(s3_client(fg.url), term)
        log = sent(s3c)
        s3c.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"shipped")
        # fencegate had not seen the key: 428, one read, the write again.
        key = "/orders-bucket/orders/42"
        assert log == [f"PUT {key}", f"HEAD {key}", f"PUT {key}"]
        log.clear()
        s3c.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"delivered")
        assert log == ["PUT /orders-bucket/orders/42"]
        s3c.delete_object(Bucket="orders-bucket", Key="orders/42")
        s3c.put_object(Bucket="orders-bucket", Key="orders/43", Body=b"new")
    got = s3_client(moto.url).get_object(Bucket="orders-bucket", Key="orders/43")
    assert got["Body"].read() == b"new"
    assert client.show("orders")["state"] == "released"


def test_a_fenced_boto3_client_is_let_go_with_its_term(s3: tuple[Server, Server]) -> None:
    # One S3 client for a worker's whole life, fenced under each term it
    # holds in turn: the first term's hooks go with it (else every write
    # under the second would raise LeaseLost for the first).
    fg, moto = s3
    client = fencegate.Client(fg.url)
    worker = s3_client(fg.url)
    with client.hold("orders", holder="w1", ttl=30.0) as first:
        fencegate.boto3.fence(worker, first)
        worker.put_object(Bucket="orders-bucket", Key="orders/7", Body=b"first")
    with client.hold("orders", holder="w1", ttl=30.0) as second:
        fencegate.boto3.fence(worker, second)
        worker.put_object(Bucket="orders-bucket", Key="orders/7", Body=b"second")
    got = s3_client(moto.url).get_object(Bucket="orders-bucket", Key="orders/7")
    assert got["Body"].read() == b"second"
    # Let go of by both: unfenced again.
    assert second.token > first.token
    with pytest.raises(worker.exceptions.ClientError) as refused:
        worker.put_object(Bucket="orders-bucket", Key="orders/7", Body=b"no term")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 428


def test_the_boto3_zombie_s_put_object_is_refused(s3: tuple[Server, Server]) -> None:
    fg, moto = s3
    client = fencegate.Client(fg.url)
    clock = ManualClock()
    # A's process has stopped running (its clock does not move); fencegate's
    # does, past the TTL, and B takes the lease.
    a = Term(client, "orders", "A", 3.0, 0.0, None, None, clock=clock).acquire()
    zombie = fencegate.boto3.fence(s3_client(fg.url), a)
    zombie.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"A's")
    advance(fg.url, 3000)
    with client.hold("orders", holder="B", ttl=30.0) as b:
        fencegate.boto3.fence(s3_client(fg.url), b).put_object(
            Bucket="orders-bucket", Key="orders/42", Body=b"B's"
        )
        a.check()  # A cannot know yet
        with pytest.raises(zombie.exceptions.ClientError) as refused:
            zombie.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"A, late")
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        # A's renewer wakes and is refused: from now on nothing is sent.
        clock.advance(1.0, a._thread)
        assert a.lost.is_set()
        log = sent(zombie)
        with pytest.raises(fencegate.LeaseLost):
            zombie.put_object(Bucket="orders-bucket", Key="orders/42", Body=b"A, later")
        assert log == []
    got = s3_client(moto.url).get_object(Bucket="orders-bucket", Key="orders/42")
    assert got["Body"].read() == b"B's"
    a.release()


DYNAMODB_CONFIG = """
upstream = "{upstream}"
[proxy]
preserve_host = true
[[fence.routes]]
kind = "dynamodb"
pattern = "/jobs/{{lease}}"
partition_key = "pk"
"""


def dynamodb_client(url: str) -> Any:
    return boto3.client(
        "dynamodb",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=botocore.config.Config(retries={"mode": "standard", "max_attempts": 1}),
    )


def test_boto3_dynamodb_writes_carry_the_token_and_dynamodb_compares_it(
    servers: Servers,
) -> None:
    moto = servers.moto()
    direct = dynamodb_client(moto.url)
    direct.create_table(
        TableName="jobs",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    fg = servers.fencegate(config=DYNAMODB_CONFIG.format(upstream=moto.url))
    client = fencegate.Client(fg.url)
    clock = ManualClock()
    key = {"pk": {"S": "orders/42"}}
    a = Term(client, "orders", "A", 3.0, 0.0, None, None, clock=clock).acquire()
    zombie = fencegate.boto3.fence(dynamodb_client(fg.url), a)
    zombie.put_item(TableName="jobs", Item={**key, "v": {"S": "A's"}})
    # The client's own condition and update are kept beside fencegate's.
    zombie.update_item(
        TableName="jobs",
        Key=key,
        UpdateExpression="SET v = :v",
        ConditionExpression="attribute_exists(pk)",
        ExpressionAttributeValues={":v": {"S": "A's, updated"}},
    )
    # A placeholder named like the clause is not the clause (found by a
    # review: `#set` was taken for SET).
    zombie.update_item(
        TableName="jobs",
        Key=key,
        UpdateExpression="ADD #set :one SET v = :v",
        ExpressionAttributeNames={"#set": "set_count"},
        ExpressionAttributeValues={":one": {"N": "1"}, ":v": {"S": "A's, updated"}},
    )
    # A transaction's items are the caller's: sent twice, the same.
    items = [{"Put": {"TableName": "jobs", "Item": {"pk": {"S": "orders/43"}}}}]
    zombie.transact_write_items(TransactItems=items)
    zombie.transact_write_items(TransactItems=items)
    assert items == [{"Put": {"TableName": "jobs", "Item": {"pk": {"S": "orders/43"}}}}]
    item = direct.get_item(TableName="jobs", Key=key)["Item"]
    assert item["v"] == {"S": "A's, updated"}
    assert item["set_count"] == {"N": "1"}
    assert item["fencing_token"] == {"N": str(a.token)}
    with pytest.raises(zombie.exceptions.ClientError) as refused:
        zombie.delete_item(TableName="jobs", Key=key)
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 428

    advance(fg.url, 3000)
    with client.hold("orders", holder="B", ttl=30.0) as b:
        fencegate.boto3.fence(dynamodb_client(fg.url), b).put_item(
            TableName="jobs", Item={**key, "v": {"S": "B's"}}
        )
        a.check()  # A cannot know yet
        with pytest.raises(zombie.exceptions.ClientError) as refused:
            zombie.put_item(TableName="jobs", Item={**key, "v": {"S": "A, late"}})
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        # A's write, as if delivered late past fencegate: DynamoDB refuses it.
        late = fencegate.boto3.fence(dynamodb_client(moto.url), a)
        with pytest.raises(late.exceptions.ConditionalCheckFailedException):
            late.put_item(TableName="jobs", Item={**key, "v": {"S": "A, later"}})
        # Reads need no term.
        got = zombie.get_item(TableName="jobs", Key=key)["Item"]
        assert got["v"] == {"S": "B's"}
        assert got["fencing_token"] == {"N": str(b.token)}
    # A's renewer wakes and is refused: from now on nothing is sent.
    clock.advance(1.0, a._thread)
    assert a.lost.is_set()
    with pytest.raises(fencegate.LeaseLost):
        zombie.put_item(TableName="jobs", Item={**key, "v": {"S": "A, lost"}})
    a.release()


DAV_CONFIG = """
upstream = "{upstream}"
[[fence.routes]]
pattern = "/dav/{{lease}}"
"""


def test_requests_writes_are_fenced_reads_are_not(servers: Servers) -> None:
    nginx = servers.nginx()
    fg = servers.fencegate(config=DAV_CONFIG.format(upstream=nginx.url))
    client = fencegate.Client(fg.url)
    clock = ManualClock()
    a = Term(client, "orders", "A", 3.0, 0.0, None, None, clock=clock).acquire()
    http = fencegate.requests.session(a)
    assert http.put(f"{fg.url}/dav/orders/42", data=b"from A").status_code == 201
    assert http.get(f"{fg.url}/dav/orders/42").text == "from A"
    advance(fg.url, 3000)
    with client.hold("orders", holder="B", ttl=30.0) as b:
        put = fencegate.requests.session(b).put(f"{fg.url}/dav/orders/42", data=b"from B")
        assert put.status_code == 204
        late = http.put(f"{fg.url}/dav/orders/42", data=b"zombie")
        assert late.status_code == 412 and late.json()["reason"] == "stale-fencing-token"
        clock.advance(1.0, a._thread)
        with pytest.raises(fencegate.LeaseLost):
            http.put(f"{fg.url}/dav/orders/42", data=b"zombie, later")
        with pytest.raises(fencegate.LeaseLost):
            http.delete(f"{fg.url}/dav/orders/42")
    assert raw("GET", f"{nginx.url}/dav/orders/42")[1] == b"from B"
    a.release()


def test_requests_on_a_route_with_preconditions_reads_a_new_key_once(
    servers: Servers,
) -> None:
    fg = servers.fencegate(
        config='[[fence.routes]]\npattern = "/kv/{lease}"\npreconditions = "etag"\n'
    )
    client = fencegate.Client(fg.url)
    seen: list[str] = []
    with client.hold("orders", holder="w1", ttl=30.0) as term:
        http = fencegate.requests.session(term)
        http.hooks["response"].append(
            lambda r, **_: seen.append(f"{r.request.method} {r.status_code}")
        )
        assert http.put(f"{fg.url}/kv/orders/42", data=b"v1").status_code == 201
        assert seen == ["PUT 428", "HEAD 404", "PUT 201"]
        seen.clear()
        assert http.put(f"{fg.url}/kv/orders/42", data=b"v2").status_code == 204
        assert seen == ["PUT 204"]
    assert raw("GET", f"{fg.url}/kv/orders/42")[1] == b"v2"


def test_requests_sends_a_file_body_again_whole_and_a_generator_s_not_at_all(
    servers: Servers,
) -> None:
    fg = servers.fencegate(
        config='[[fence.routes]]\npattern = "/kv/{lease}"\npreconditions = "etag"\n'
    )
    client = fencegate.Client(fg.url)
    with client.hold("orders", holder="w1", ttl=30.0) as term:
        http = fencegate.requests.session(term)
        body = io.BytesIO(b"from a file")
        assert http.put(f"{fg.url}/kv/orders/1", data=body).status_code == 201
        assert raw("GET", f"{fg.url}/kv/orders/1")[1] == b"from a file"
        spent = http.put(f"{fg.url}/kv/orders/2", data=(c for c in [b"from ", b"a generator"]))
        assert spent.status_code == 428, "a spent body is not sent again"
        assert raw("GET", f"{fg.url}/kv/orders/2")[0] == 404


class _Redirect(http.server.BaseHTTPRequestHandler):
    to: ClassVar[str]
    seen: ClassVar[list[dict[str, str]]]

    def do_PUT(self) -> None:
        type(self).seen.append(dict(self.headers))
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if type(self).to:
            self.send_response(307)
            self.send_header("location", type(self).to + self.path)
        else:
            self.send_response(201)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def redirecting(to: str, host: str = "127.0.0.1") -> Iterator[tuple[str, type[_Redirect]]]:
    class R(_Redirect):
        seen: ClassVar[list[dict[str, str]]] = []

    R.to = to
    s = http.server.ThreadingHTTPServer((host, 0), R)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{s.server_address[1]}", R
    finally:
        s.shutdown()
        s.server_close()


def test_requests_drops_the_fencing_headers_on_a_redirect_to_another_host(
    servers: Servers,
) -> None:
    fg = servers.fencegate()
    with fencegate.Client(fg.url).hold("orders", holder="w1", ttl=30.0) as term:
        http_ = fencegate.requests.session(term)
        # 127.0.0.2 is another host (loopback all the same).
        with redirecting("", "127.0.0.2") as (other, elsewhere), redirecting(other) as (url, here):
            assert http_.put(f"{url}/kv/orders/1", data=b"v").status_code == 201
    assert here.seen[0]["Fencing-Lease-Id"] == term.lease_id
    assert "Fencing-Lease-Id" not in elsewhere.seen[0]
    assert "Fencing-Token" not in elsewhere.seen[0]
