"""What can go wrong, as exceptions that carry what fencegate said."""

from __future__ import annotations

from typing import Any


class FencegateError(Exception):
    """Any failure of a call to fencegate."""


class ProblemError(FencegateError):
    """fencegate answered with a problem document (RFC 9457).

    ``reason`` is its stable ``reason`` member (``lease-held``,
    ``stale-fencing-token``, ``precondition-required``, ...), ``status`` the
    HTTP status, ``retry_after`` the seconds ``Retry-After`` asked for (or
    ``None``), ``body`` the whole document.
    """

    def __init__(
        self,
        status: int,
        reason: str,
        detail: str,
        retry_after: float | None,
        body: dict[str, Any],
    ) -> None:
        super().__init__(f"{status} {reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail
        self.retry_after = retry_after
        self.body = body


class Unreachable(FencegateError):
    """No member answered (refused, timed out, broken connection)."""


class LeaseLost(FencegateError):
    """The term is lost (or over): stop writing under it.

    Raised before a write is sent once a renewal was refused, the local
    deadline passed without a renewal, the renewer died, or the term was
    released (by :meth:`~fencegate.Term.check` and ``headers()``, and a
    fenced ``requests`` session; a fenced boto3 client lets go of a
    released term instead: its writes go unfenced, which fencegate
    refuses on a route that guards them). ``reason`` says which.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"the lease is lost: {reason}")
        self.reason = reason
