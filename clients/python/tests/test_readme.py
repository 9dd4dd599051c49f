"""The README's Python example, run as printed against `fencegate serve`
(the embedded store, its own clock), with only the address changed: it
prints what its `#>` lines say."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import Servers, raw


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
