"""Holding a term: renewed in the background, failing closed.

The rules (each has a test):

- a term is renewed every third of its TTL;
- its local deadline is the monotonic time the last successful renewal
  (or the acquire) was *sent*, plus the ``expires_in`` fencegate answered,
  minus a margin (default a tenth of the TTL): never wall time, and never
  later than fencegate's own deadline;
- the term is lost when a renewal is refused, when the local deadline
  passes without a successful renewal, or when the renewer dies: a renew
  loop that stops is a loss, not silence;
- once lost (or released), :meth:`Term.check` raises
  :class:`~fencegate.LeaseLost`, so nothing more is written under it;
- it is released once, never twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ._transport import FENCING_LEASE_ID, FENCING_TOKEN
from .errors import LeaseLost, ProblemError, Unreachable

if TYPE_CHECKING:
    from .client import Client, Grant


class Clock(Protocol):
    """Where the renewer reads time and waits (tests give a manual one)."""

    def monotonic(self) -> float: ...

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Waits until ``event`` is set or ``timeout`` seconds pass:
        whether it was set."""
        ...


class MonotonicClock:
    """The process's monotonic clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))


class AsyncClock(Protocol):
    """Where the asyncio renewer reads time and sleeps."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The running event loop's clock (monotonic)."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class _Schedule:
    """When to renew next and when the term ends locally."""

    def __init__(self, grant: Grant, sent: float, margin: float) -> None:
        self.ttl = grant.ttl
        self.margin = margin
        self.deadline = 0.0
        self.next_renew = 0.0
        self.renewed(grant, sent)

    def renewed(self, grant: Grant, sent: float) -> None:
        self.deadline = sent + grant.expires_in - self.margin
        self.next_renew = sent + self.ttl / 3


class Term:
    """A held term of a lease. Use it as a context manager::

        with client.hold("orders", holder="w1", ttl=10.0) as term:
            term.check()                  # LeaseLost once it is lost
            put(..., headers=term.headers())

    ``lost`` is a :class:`threading.Event` set when the term is lost;
    ``on_lost`` (if given) is called with the reason, from the renewer.
    """

    def __init__(
        self,
        client: Client,
        grant: Grant,
        sent: float,
        margin: float | None,
        on_lost: Callable[[str], None] | None,
        clock: Clock,
    ) -> None:
        self._client = client
        self.lease = grant.lease
        self.holder = grant.holder
        self.token = grant.token
        self.lease_id = grant.lease_id
        self.ttl = grant.ttl
        self.lost = threading.Event()
        self._reason: str | None = None
        self._on_lost = on_lost
        self._clock = clock
        self._schedule = _Schedule(grant, sent, grant.ttl / 10 if margin is None else margin)
        self._stop = threading.Event()
        self._released = False
        self._release_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"fencegate-renew-{grant.lease}", daemon=True
        )

    @classmethod
    def _start(
        cls,
        client: Client,
        lease: str,
        holder: str,
        ttl: float,
        wait: float,
        margin: float | None,
        on_lost: Callable[[str], None] | None,
        clock: Clock | None = None,
    ) -> Term:
        clock = clock or MonotonicClock()
        sent = clock.monotonic()
        grant = client.acquire(lease, holder, ttl, wait)
        # After a wait, the send time says nothing of when the term began:
        # a renewal now gives the local deadline a fresh start.
        if clock.monotonic() - sent >= grant.ttl / 10:
            sent = clock.monotonic()
            try:
                grant = client._renew(lease, grant.token, grant.lease_id, None, None)
            except BaseException:
                with contextlib.suppress(Exception):
                    client.release(lease, grant.token, grant.lease_id)
                raise
        term = cls(client, grant, sent, margin, on_lost, clock)
        term._thread.start()
        return term

    # -- what the holder asks --------------------------------------------

    @property
    def lost_reason(self) -> str | None:
        """Why the term is lost, or ``None`` while it is held."""
        return self._reason

    def check(self) -> None:
        """Raises :class:`~fencegate.LeaseLost` unless the term is held
        right now: not released, not lost, its local deadline not passed
        (read from the monotonic clock here, whatever the renewer is doing),
        and its renewer alive."""
        if self._released:
            raise LeaseLost("the term was released")
        if self._reason is None:
            if self._clock.monotonic() >= self._schedule.deadline:
                self._lose("no renewal succeeded before the local deadline")
            elif not self._thread.is_alive():
                self._lose("the renewer stopped")
        if self._reason is not None:
            raise LeaseLost(self._reason)

    def headers(self) -> dict[str, str]:
        """The fencing headers of the term, for any HTTP client. Raises
        :class:`~fencegate.LeaseLost` instead once it is lost."""
        self.check()
        return {FENCING_TOKEN: str(self.token), FENCING_LEASE_ID: self.lease_id}

    def release(self) -> None:
        """Stops renewing and releases the term (once: a second call does
        nothing). A lost term is not released: it is over at fencegate, or
        will be within the margin."""
        with self._release_lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._client.transport.timeout)
        if self._reason is None:
            try:
                self._client.release(self.lease, self.token, self.lease_id)
            except ProblemError as e:
                # Already ended at fencegate (expired, superseded): nothing
                # to release.
                if e.reason not in ("lease-expired", "lease-released", "stale-fencing-token"):
                    raise

    def __enter__(self) -> Term:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- the renewer ------------------------------------------------------

    def _lose(self, reason: str) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        self.lost.set()
        if self._on_lost is not None:
            with contextlib.suppress(Exception):
                self._on_lost(reason)

    def _run(self) -> None:
        try:
            self._renew_loop()
        except BaseException as e:
            self._lose(f"the renewer failed: {e!r}")
            raise
        finally:
            if not self._stop.is_set():
                self._lose("the renewer stopped")

    def _renew_loop(self) -> None:
        s = self._schedule
        clock = self._clock
        while True:
            now = clock.monotonic()
            if clock.wait(self._stop, min(s.deadline, s.next_renew) - now):
                return
            now = clock.monotonic()
            if now >= s.deadline:
                self._lose("no renewal succeeded before the local deadline")
                return
            if now < s.next_renew:
                continue
            sent = now
            try:
                grant = self._client._renew(
                    self.lease,
                    self.token,
                    self.lease_id,
                    None,
                    max(0.01, s.deadline - sent),
                )
            except ProblemError as e:
                if e.reason == "not-primary":
                    # A cluster between primaries: the deadline decides.
                    s.next_renew = clock.monotonic() + 0.1
                    continue
                self._lose(f"a renewal was refused ({e.reason})")
                return
            except Unreachable:
                s.next_renew = clock.monotonic() + 0.05
                continue
            if self._stop.is_set():
                return
            s.renewed(grant, sent)


class AsyncTerm:
    """:class:`Term` for asyncio::

        async with client.hold_async("orders", holder="w1", ttl=10.0) as term:
            term.check()

    The renewer is a task on the running loop (each renewal runs in a
    thread, as the calls are blocking); ``lost`` is an :class:`asyncio.Event`.
    """

    def __init__(
        self,
        client: Client,
        lease: str,
        holder: str,
        ttl: float,
        wait: float,
        margin: float | None,
        on_lost: Callable[[str], None] | None,
        clock: AsyncClock | None = None,
    ) -> None:
        self._client = client
        self._clock: AsyncClock = clock or LoopClock()
        self._args = (lease, holder, ttl, wait)
        self._margin = margin
        self._on_lost = on_lost
        self.lost = asyncio.Event()
        self._reason: str | None = None
        self._released = False
        self._task: asyncio.Task[None] | None = None
        self._schedule: _Schedule | None = None
        self.lease = lease
        self.token = 0
        self.lease_id = ""

    async def __aenter__(self) -> AsyncTerm:
        clock = self._clock
        lease, holder, ttl, wait = self._args
        sent = clock.monotonic()
        grant = await asyncio.to_thread(self._client.acquire, lease, holder, ttl, wait)
        if clock.monotonic() - sent >= grant.ttl / 10:
            sent = clock.monotonic()
            try:
                grant = await asyncio.to_thread(
                    self._client._renew, lease, grant.token, grant.lease_id, None, None
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(
                        self._client.release, lease, grant.token, grant.lease_id
                    )
                raise
        self.token, self.lease_id = grant.token, grant.lease_id
        margin = grant.ttl / 10 if self._margin is None else self._margin
        self._schedule = _Schedule(grant, sent, margin)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    @property
    def lost_reason(self) -> str | None:
        return self._reason

    def _lose(self, reason: str) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        self.lost.set()
        if self._on_lost is not None:
            with contextlib.suppress(Exception):
                self._on_lost(reason)

    def check(self) -> None:
        """As :meth:`Term.check`."""
        if self._released:
            raise LeaseLost("the term was released")
        s = self._schedule
        if self._reason is None and s is not None:
            if self._clock.monotonic() >= s.deadline:
                self._lose("no renewal succeeded before the local deadline")
            elif self._task is not None and self._task.done():
                self._lose("the renewer stopped")
        if self._reason is not None:
            raise LeaseLost(self._reason)

    def headers(self) -> dict[str, str]:
        """As :meth:`Term.headers`."""
        self.check()
        return {FENCING_TOKEN: str(self.token), FENCING_LEASE_ID: self.lease_id}

    async def release(self) -> None:
        """As :meth:`Term.release`."""
        if self._released:
            return
        self._released = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._reason is None:
            try:
                await asyncio.to_thread(self._client.release, self.lease, self.token, self.lease_id)
            except ProblemError as e:
                if e.reason not in ("lease-expired", "lease-released", "stale-fencing-token"):
                    raise

    async def _run(self) -> None:
        try:
            await self._renew_loop()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._lose(f"the renewer failed: {e!r}")
        finally:
            if not self._released:
                self._lose("the renewer stopped")

    async def _renew_loop(self) -> None:
        s = self._schedule
        assert s is not None
        clock = self._clock
        while True:
            await clock.sleep(min(s.deadline, s.next_renew) - clock.monotonic())
            now = clock.monotonic()
            if now >= s.deadline:
                self._lose("no renewal succeeded before the local deadline")
                return
            if now < s.next_renew:
                continue
            sent = now
            try:
                grant = await asyncio.to_thread(
                    self._client._renew,
                    self.lease,
                    self.token,
                    self.lease_id,
                    None,
                    max(0.01, s.deadline - sent),
                )
            except ProblemError as e:
                if e.reason == "not-primary":
                    s.next_renew = clock.monotonic() + 0.1
                    continue
                self._lose(f"a renewal was refused ({e.reason})")
                return
            except Unreachable:
                s.next_renew = clock.monotonic() + 0.05
                continue
            s.renewed(grant, sent)
