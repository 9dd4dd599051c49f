"""A holder paused past its term (SIGSTOP of a child process): when it runs
again it finds LeaseLost before writing, and the write it would send anyway
is refused by fencegate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import Servers, advance, raw

import fencegate

CHILD = r"""
import json, sys, urllib.error, urllib.request
import fencegate

url = sys.argv[1]

def put(body, headers):
    req = urllib.request.Request(url + "/kv/job/out", data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.load(e).get("reason")

client = fencegate.Client(url)
with client.hold("job", holder="child", ttl=2.0) as term:
    held = term.headers()
    print(json.dumps({"wrote": put(b"child", term.headers())[0]}), flush=True)
    sys.stdin.readline()  # stopped and continued meanwhile
    try:
        term.check()
        lost = None
    except fencegate.LeaseLost as e:
        lost = e.reason
    # A zombie writes anyway, with the headers it held.
    status, reason = put(b"child, late", held)
    print(json.dumps({"lost": lost, "late": [status, reason]}), flush=True)
"""


def test_a_holder_paused_past_its_term_finds_it_lost_and_its_write_refused(
    servers: Servers,
) -> None:
    fg = servers.fencegate()  # fencegate's clock moves only when told
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, fg.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert json.loads(child.stdout.readline()) == {"wrote": 201}
        child.send_signal(signal.SIGSTOP)
        # fencegate's clock runs the term out; B takes the lease and writes.
        advance(fg.url, 2000)
        b = fencegate.Client(fg.url).acquire("job", "B", ttl=60.0)
        headers = {"Fencing-Token": str(b.token), "Fencing-Lease-Id": b.lease_id}
        assert raw("PUT", f"{fg.url}/kv/job/out", b"B", headers)[0] == 204
        # The child's own (real) clock must pass its local
        # deadline while it is stopped: at most 1.8 s after its last
        # renewal, sent before the stop. 3 s of real time leaves margin on
        # a loaded machine; nothing here depends on fencegate's timing.
        time.sleep(3.0)
        child.send_signal(signal.SIGCONT)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        got = json.loads(child.stdout.readline())
        assert got["lost"] is not None and "deadline" in got["lost"], got
        assert got["late"] == [412, "stale-fencing-token"]
        assert child.wait(30) == 0
        assert raw("GET", f"{fg.url}/kv/job/out")[1] == b"B"
    finally:
        child.kill()
        child.wait()
