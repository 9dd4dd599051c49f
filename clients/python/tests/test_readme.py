"""The README's Python example, run as printed against `fencegate serve`
(the embedded store, its own clock), with only the address changed: it
prints what its `#>` lines say."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import Servers, raw
from test_integrations import DYNAMODB_CONFIG, dynamodb_client, s3_client


def readme_block(marker: str) -> str:
    path = os.environ.get("FENCEGATE_README") or os.path.join(
        os.path.dirname(__file__), "..", "..", "..", "README.md"
    )
    with open(path) as f:
        after = f.read().split(marker, 1)[1]
    return after.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_readme_python_example_as_printed(servers: Servers) -> None:
    block = readme_block("<!-- python-example -->")
    expected = [line[3:] for line in block.splitlines() if line.startswith("#> ")]
    assert expected, "the example says what it prints"
    fg = servers.fencegate(manual=False)
    script = block.replace("http://127.0.0.1:8080", fg.url)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected
    # The term was released on leaving the block; what it wrote is there.
    assert raw("GET", f"{fg.url}/kv/invoices/7")[1] == b"paid"
    assert b'"state":"released"' in raw("GET", f"{fg.url}/_fence/leases/invoices")[1]


S3 = """
upstream = "{upstream}"
[proxy]
preserve_host = true
[[fence.routes]]
pattern = "/orders-bucket/{{lease}}"
preconditions = "etag"
"""


def test_the_client_readme_examples_as_written(servers: Servers) -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        text = f.read()
    blocks = [b.split("\n```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 3, "the README's examples"
    fg = servers.fencegate(manual=False)
    moto = servers.moto()
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    s3_client(moto.url).create_bucket(Bucket="orders-bucket")
    s3 = servers.fencegate(config=S3.format(upstream=moto.url), manual=False, name="s3")
    dynamodb_client(moto.url).create_table(
        TableName="jobs",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    dynamodb = servers.fencegate(
        config=DYNAMODB_CONFIG.format(upstream=moto.url), manual=False, name="dynamodb"
    )
    for block in blocks:
        script = (
            block.replace("http://127.0.0.1:8080", fg.url)
            .replace("http://127.0.0.1:8280", s3.url)
            .replace("http://127.0.0.1:8380", dynamodb.url)
        )
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **aws},
        )
        assert out.returncode == 0, f"{block}\n{out.stderr}"
    assert raw("GET", f"{fg.url}/kv/orders/42")[1] == b"shipped"
    got = s3_client(moto.url).get_object(Bucket="orders-bucket", Key="orders/42")
    assert got["Body"].read() == b"shipped"
    item = dynamodb_client(moto.url).get_item(TableName="jobs", Key={"pk": {"S": "orders/42"}})
    assert "fencing_token" in item["Item"]


def test_the_readme_dynamodb_example_as_printed(servers: Servers) -> None:
    block = readme_block("<!-- dynamodb-example -->")
    moto = servers.moto()
    dynamodb_client(moto.url).create_table(
        TableName="jobs",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    fg = servers.fencegate(config=DYNAMODB_CONFIG.format(upstream=moto.url), manual=False)
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    script = block.replace("http://127.0.0.1:8380", fg.url)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **aws},
    )
    assert out.returncode == 0, out.stderr
    item = dynamodb_client(moto.url).get_item(TableName="jobs", Key={"pk": {"S": "orders/42"}})
    assert item["Item"]["fencing_token"] == {"N": "1"}
