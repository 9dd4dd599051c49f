"""Real servers for the client's tests: the `fencegate` binary (its path in
FENCEGATE_BIN), nginx with WebDAV (NGINX), moto's S3 server (from this
venv) and etcd (ETCD), each on a free loopback port, stopped by its own
process id. `tests/python_client.rs` runs this suite with those set."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: str
    dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_text(self) -> str:
        with open(self.log) as f:
            return f.read()


def _announced(proc: subprocess.Popen[bytes], log: str, what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"listening on (https?://\S+)", line)
    if not m:
        proc.kill()
        with open(log) as f:
            raise AssertionError(f"{what} did not start: {line!r}\n{f.read()}")
    return m.group(1)


class Servers:
    """Starts servers for one test; stops them all after it."""

    def __init__(self) -> None:
        self.started: list[Server] = []
        self.dir = tempfile.mkdtemp(prefix="fencegate-py-")

    def fencegate(
        self,
        *args: str,
        config: str | None = None,
        env: dict[str, str] | None = None,
        manual: bool = True,
        name: str = "fencegate",
        listen: str = "127.0.0.1:0",
    ) -> Server:
        bin_ = os.environ["FENCEGATE_BIN"]
        d = tempfile.mkdtemp(dir=self.dir, prefix=name + "-")
        cmd = [bin_, "serve", "--listen", listen, "--data-dir", os.path.join(d, "data")]
        if manual:
            cmd += ["--clock", "manual"]
        if config is not None:
            path = os.path.join(d, "fencegate.toml")
            with open(path, "w") as f:
                f.write(config)
            cmd += ["--config", path]
        cmd += list(args)
        log = os.path.join(d, "fencegate.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "FENCEGATE_LOG": "info", **(env or {})},
            )
        url = _announced(proc, log, name)
        s = Server(url, proc, log, d)
        self.started.append(s)
        return s

    def backend(self) -> Server:
        bin_ = os.environ["FENCEGATE_BIN"]
        d = tempfile.mkdtemp(dir=self.dir, prefix="backend-")
        log = os.path.join(d, "backend.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [bin_, "backend", "--listen", "127.0.0.1:0"],
                stdout=subprocess.PIPE,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )
        s = Server(_announced(proc, log, "backend"), proc, log, d)
        self.started.append(s)
        return s

    def _wait_port(self, port: int, proc: subprocess.Popen[bytes], log: str, what: str) -> None:
        # Real time, bounded: a server starting, not a lease.
        for _ in range(500):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if proc.poll() is not None:
                with open(log) as f:
                    raise AssertionError(f"{what} exited: {f.read()}")
            time.sleep(0.02)
        raise AssertionError(f"{what} did not listen on {port}")

    def nginx(self) -> Server:
        d = tempfile.mkdtemp(dir=self.dir, prefix="nginx-")
        os.makedirs(os.path.join(d, "www", "dav"))
        port = free_port()
        conf = os.path.join(d, "nginx.conf")
        with open(conf, "w") as f:
            f.write(
                f"daemon off; master_process off; worker_processes 1; pid {d}/nginx.pid;\n"
                f"error_log {d}/error.log warn; events {{ worker_connections 64; }}\n"
                f"http {{ access_log off; client_body_temp_path {d}/body;"
                f" proxy_temp_path {d}/p; fastcgi_temp_path {d}/f; uwsgi_temp_path {d}/u;"
                f" scgi_temp_path {d}/s;\n"
                f"  server {{ listen 127.0.0.1:{port}; root {d}/www;\n"
                f"    location /dav/ {{ dav_methods PUT DELETE MKCOL COPY MOVE;"
                f" create_full_put_path on; }} }} }}\n"
            )
        log = os.path.join(d, "error.log")
        proc = subprocess.Popen(
            [os.environ["NGINX"], "-p", d, "-c", conf, "-e", log],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        self._wait_port(port, proc, log, "nginx")
        s = Server(f"http://127.0.0.1:{port}", proc, log, d)
        self.started.append(s)
        return s

    def moto(self) -> Server:
        d = tempfile.mkdtemp(dir=self.dir, prefix="moto-")
        port = free_port()
        log = os.path.join(d, "moto.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=d,
            )
        self._wait_port(port, proc, log, "moto_server")
        s = Server(f"http://127.0.0.1:{port}", proc, log, d)
        self.started.append(s)
        return s

    def etcd(self) -> Server:
        d = tempfile.mkdtemp(dir=self.dir, prefix="etcd-")
        client, peer = free_port(), free_port()
        log = os.path.join(d, "etcd.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    os.environ["ETCD"],
                    "--name",
                    "py",
                    "--data-dir",
                    os.path.join(d, "data"),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-cluster",
                    f"py=http://127.0.0.1:{peer}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_port(client, proc, log, "etcd")
        s = Server(f"http://127.0.0.1:{client}", proc, log, d)
        self.started.append(s)
        return s

    def stop(self) -> None:
        for s in reversed(self.started):
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.stop()


def advance(url: str, ms: int) -> None:
    """Moves a manual-clock fencegate's clock on by `ms`."""
    req = urllib.request.Request(
        f"{url}/_fence/clock",
        data=json.dumps({"advance_ms": ms}).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def raw(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One request with nothing of the client in between: (status, body)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
