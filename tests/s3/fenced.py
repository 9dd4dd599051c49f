"""boto3 through fencegate in front of Garage, an S3 server that checks
signatures, on a route with preconditions: fencegate adds If-Match or
If-None-Match to the signed requests, and Garage's signature check still
passes (Garage itself ignores the preconditions).

Run by tests/examples.rs (s3_example_as_shipped) with the test's venv:

    python fenced.py FENCEGATE_URL S3_URL KEY_ID SECRET REGION

The bucket `orders-bucket` exists and the key may read and write it.
fencegate runs config/examples/s3.toml: writes under /orders-bucket/{lease}/
are fenced. Each step asserts; the script prints "ok" at the end.
"""

import json
import sys
import urllib.request

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

FENCEGATE, S3, KEY_ID, SECRET, REGION = sys.argv[1:6]
BUCKET = "orders-bucket"

# The fencing headers of the term the next requests are sent under. They
# are added after SigV4 has signed the request ("before-send"), so they are
# not signed: fencegate removes Fencing-Lease-Id and rewrites Fencing-Token,
# and a signed header it changed would fail the server's check.
fencing = {}


def add_fencing(request, **_):
    for name, value in fencing.items():
        request.headers[name] = value


def client(endpoint, secret=None):
    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=secret or SECRET,
        region_name=REGION,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    c.meta.events.register("before-send.s3.*", add_fencing)
    return c


s3 = client(FENCEGATE)
direct = client(S3)


def lease_api(method, name, body=None, held=None):
    req = urllib.request.Request(
        f"{FENCEGATE}/_fence/leases/{name}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json", **(held_headers(held) if held else {})},
    )
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read() or b"null")


def held_headers(held):
    return {"Fencing-Token": str(held["token"]), "Fencing-Lease-Id": held["lease_id"]}


def acquire(holder):
    return lease_api("POST", "orders", {"holder": holder, "ttl_ms": 60000})


def release(held):
    lease_api("DELETE", "orders", held=held)


def fenced(call, key, **kwargs):
    """The README's pattern: a write fencegate answers 428 (it knows no
    state of the key yet) is sent again after one read of the key."""
    try:
        return call(Bucket=BUCKET, Key=key, **kwargs)
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] != 428:
            raise
    try:
        s3.head_object(Bucket=BUCKET, Key=key)
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] != 404:
            raise
    return call(Bucket=BUCKET, Key=key, **kwargs)


def under(held):
    fencing.clear()
    fencing.update(held_headers(held))


def refused(call):
    """`call` must be refused by fencegate as stale (412), landing nothing."""
    try:
        call()
    except ClientError as e:
        status = e.response["ResponseMetadata"]["HTTPStatusCode"]
        assert status == 412, e.response
        return
    raise AssertionError("a stale request was not refused")


def body(key_name):
    return direct.get_object(Bucket=BUCKET, Key=key_name)["Body"].read()


def absent(key_name):
    try:
        direct.head_object(Bucket=BUCKET, Key=key_name)
    except ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 404, e.response
        return
    raise AssertionError(f"{key_name} exists")


# Signatures survive fencegate: a signed PUT through it is verified by the
# server, and one signed with a wrong secret is refused by the server.
a = acquire("A")
under(a)
try:
    s3.put_object(Bucket=BUCKET, Key="orders/1", Body=b"from A")
    raise AssertionError("a write of a key fencegate knows nothing of went through")
except ClientError as e:
    assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 428, e.response
fenced(s3.put_object, "orders/1", Body=b"from A")
assert body("orders/1") == b"from A"
try:
    client(FENCEGATE, secret="wrong").put_object(Bucket=BUCKET, Key="orders/1", Body=b"forged")
    raise AssertionError("a wrong signature was accepted")
except ClientError as e:
    assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.response
assert body("orders/1") == b"from A"

# A multipart upload begun by A, one part sent...
upload = s3.create_multipart_upload(Bucket=BUCKET, Key="orders/big")["UploadId"]
part1 = s3.upload_part(
    Bucket=BUCKET, Key="orders/big", UploadId=upload, PartNumber=1, Body=b"x" * (5 * 1024 * 1024)
)

# ...then the lease moves on: A is a former holder.
release(a)
b = acquire("B")
assert b["token"] > a["token"]

under(a)
refused(lambda: s3.put_object(Bucket=BUCKET, Key="orders/1", Body=b"stale A"))
refused(lambda: s3.delete_object(Bucket=BUCKET, Key="orders/1"))
refused(
    lambda: s3.copy_object(
        Bucket=BUCKET, Key="orders/copy", CopySource={"Bucket": BUCKET, "Key": "orders/1"}
    )
)
refused(
    lambda: s3.upload_part(
        Bucket=BUCKET, Key="orders/big", UploadId=upload, PartNumber=2, Body=b"stale part"
    )
)
refused(
    lambda: s3.complete_multipart_upload(
        Bucket=BUCKET,
        Key="orders/big",
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part1["ETag"]}]},
    )
)
assert body("orders/1") == b"from A"
absent("orders/copy")
absent("orders/big")

# B's term: a single PUT, a copy, a delete and a whole multipart upload.
under(b)
fenced(s3.put_object, "orders/1", Body=b"from B")
fenced(s3.copy_object, "orders/copy", CopySource={"Bucket": BUCKET, "Key": "orders/1"})
assert body("orders/copy") == b"from B"
fenced(s3.delete_object, "orders/copy")
absent("orders/copy")
upload = s3.create_multipart_upload(Bucket=BUCKET, Key="orders/big")["UploadId"]
parts = []
for n, data in [(1, b"1" * (5 * 1024 * 1024)), (2, b"2" * 1024)]:
    etag = s3.upload_part(Bucket=BUCKET, Key="orders/big", UploadId=upload, PartNumber=n, Body=data)["ETag"]
    parts.append({"PartNumber": n, "ETag": etag})
fenced(
    s3.complete_multipart_upload, "orders/big", UploadId=upload, MultipartUpload={"Parts": parts}
)
assert len(body("orders/big")) == 5 * 1024 * 1024 + 1024
# Unfenced reads go through with no term at all.
fencing.clear()
assert s3.get_object(Bucket=BUCKET, Key="orders/1")["Body"].read() == b"from B"
release(b)
print("ok")
