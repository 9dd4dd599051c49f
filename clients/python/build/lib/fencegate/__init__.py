"""fencegate's Python client: hold a lease the safe way, fence your writes.

::

    import fencegate

    client = fencegate.Client("http://127.0.0.1:8080")
    with client.hold("orders", holder="w1", ttl=10.0) as term:
        term.check()                      # LeaseLost once the term is lost
        headers = term.headers()          # Fencing-Token, Fencing-Lease-Id

``fencegate.boto3.fence(s3, term)`` and ``fencegate.requests.session(term)``
fence the writes of boto3 and requests. Standard library only; the boto3
and requests integrations need those packages (the ``boto3`` and
``requests`` extras).
"""

from .client import Client, Grant
from .errors import FencegateError, LeaseLost, ProblemError, Unreachable
from .term import AsyncTerm, Term

__all__ = [
    "AsyncTerm",
    "Client",
    "FencegateError",
    "Grant",
    "LeaseLost",
    "ProblemError",
    "Term",
    "Unreachable",
]
