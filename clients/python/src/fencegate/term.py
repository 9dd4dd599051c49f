"""Holding a term: renewed in the background, failing closed.

The rules (each has a test):

- a term is renewed every third of its TTL;
- its local deadline is the time the last successful renewal (or the
  acquire) was *sent*, plus the ``expires_in`` fencegate answered, minus a
  margin (default a tenth of the TTL), on a clock that counts the time the
  machine spent suspended, as fencegate's does (``CLOCK_BOOTTIME`` where the
  platform has it, Linux; elsewhere the monotonic clock): never wall time,
  and never later than fencegate's own deadline;
- a renewal gives up at the local deadline, however many members it tries;
- the term is lost when a renewal is refused, when the local deadline
  passes without a successful renewal, or when the renewer dies: a renew
  loop that stops is a loss, not silence; once lost, it is never renewed
  again;
- once lost (or released), :meth:`Term.check` raises
  :class:`~fencegate.LeaseLost`, so nothing more is written under it;
- it is released once, never twice (a term lost to a refused renewal is
  over at fencegate and not released; one lost otherwise is, so the next
  holder need not wait for it to expire).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ._transport import FENCING_LEASE_ID, FENCING_TOKEN
from .errors import FencegateError, LeaseLost, ProblemError, Unreachable

if TYPE_CHECKING:
    from .client import Client, Grant

#: What a refused renewal or release says when fencegate already ended the
#: term: nothing to release.
_ENDED = ("lease-expired", "lease-released", "stale-fencing-token")


#: ``CLOCK_BOOTTIME`` where the platform has it (Linux), else ``None``.
_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def _system_time() -> float:
    """Seconds on the clock a term's deadline is measured on. Where the
    platform has it (Linux), ``CLOCK_BOOTTIME``: monotonic, and it goes on
    while the machine is suspended, as fencegate's own clock does, so a
    deadline that passed while the machine slept has passed when it wakes
    (``CLOCK_MONOTONIC``, which :func:`time.monotonic` and asyncio's loop
    time read, stands still during a suspend). Elsewhere
    :func:`time.monotonic`.

    Only the checks read it: the waits (``Event.wait``, ``asyncio.sleep``)
    stay relative, on the normal timers, so a renewer asleep across a
    suspend wakes that much late and then sees the right time."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


class Clock(Protocol):
    """Where the renewer reads time and waits (tests give a manual one)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (its origin is its own)."""
        ...

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Waits until ``event`` is set or ``timeout`` seconds pass:
        whether it was set."""
        ...


class SystemClock:
    """The system's clock that counts suspend (``CLOCK_BOOTTIME`` on
    Linux; see :func:`_system_time`), with the normal timers for waits."""

    def monotonic(self) -> float:
        return _system_time()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))


class AsyncClock(Protocol):
    """Where the asyncio renewer reads time and sleeps."""

    def monotonic(self) -> float:
        """As :meth:`Clock.monotonic`."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """:class:`SystemClock`'s time, readable from any thread (a fenced
    call run with ``asyncio.to_thread`` checks the term), with asyncio's
    sleep for the renewer. Deadlines are never compared with the loop's
    own time (``loop.time()``, the monotonic clock): the sleeps are
    relative."""

    def monotonic(self) -> float:
        return _system_time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


def _margin(ttl: float, margin: float | None) -> float | None:
    """``margin``, checked: the local deadline must stay before fencegate's
    and after the first renewal is due."""
    if margin is not None and not 0 <= margin < ttl * 2 / 3:
        raise ValueError(f"margin {margin} s: give 0 <= margin < 2/3 of the TTL ({ttl} s)")
    return margin


#: Why a term whose local deadline passed is lost.
_PAST_DEADLINE = "no renewal succeeded before the local deadline"


class _Schedule:
    """When to renew next and when the term ends locally: the renewal
    rules, which the thread's renewer and the asyncio task both follow."""

    def __init__(self, grant: Grant, sent: float, margin: float) -> None:
        self.ttl = grant.ttl
        self.margin = margin
        self.deadline = 0.0
        self.next_renew = 0.0
        self.renewed(grant, sent)

    @staticmethod
    def fresh_start(grant: Grant, sent: float, now: float) -> bool:
        """Whether an acquire sent at ``sent`` and answered by ``now`` waited
        long enough (a tenth of the TTL) that its send time says nothing of
        when the term began: a renewal then gives the local deadline a
        fresh start."""
        return now - sent >= grant.ttl / 10

    def renewed(self, grant: Grant, sent: float) -> None:
        """A renewal sent at ``sent`` succeeded."""
        self.deadline = sent + grant.expires_in - self.margin
        self.next_renew = sent + self.ttl / 3

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the renewer has something to do."""
        return min(self.deadline, self.next_renew) - now

    def due(self, now: float) -> str | None:
        """At ``now``: the loss if the local deadline passed, ``""`` if a
        renewal is due, ``None`` if nothing is yet."""
        if now >= self.deadline:
            return _PAST_DEADLINE
        return "" if now >= self.next_renew else None

    def renewal(
        self,
        client: Client,
        lease: str,
        token: int,
        lease_id: str,
        clock: Clock | AsyncClock,
        sent: float,
    ) -> Callable[[], Grant]:
        """The renewal to send at ``sent``: it may take until the local
        deadline, whichever members it tries."""
        return functools.partial(
            client.renew,
            lease,
            token,
            lease_id,
            timeout=max(0.01, self.deadline - sent),
            budget=lambda: self.deadline - clock.monotonic(),
        )

    def failed(self, error: FencegateError, now: float) -> tuple[str, bool] | None:
        """A renewal failed at ``now``: ``None`` if it is tried again (a
        cluster between primaries: 0.1 s on, the deadline decides; out of
        reach: 0.05 s on), else the loss and whether fencegate refused it."""
        if isinstance(error, ProblemError):
            if error.reason == "not-primary":
                self.next_renew = now + 0.1
                return None
            return f"a renewal was refused ({error.reason})", True
        self.next_renew = now + 0.05
        return None


class _Loss:
    """Why a term is lost, recorded once."""

    def __init__(self, on_lost: Callable[[str], None] | None) -> None:
        self.reason: str | None = None
        self.refused = False
        self._on_lost = on_lost
        self._lock = threading.Lock()

    def lose(self, reason: str, refused: bool = False) -> bool:
        """Records the loss; whether it was the first."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
            self.refused = refused
        if self._on_lost is not None:
            with contextlib.suppress(Exception):
                self._on_lost(reason)
        return True


class _Released:
    """What is to be done once a term is released (the hooks a fenced
    client registered for it, taken off), each once."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._done = False
        self._lock = threading.Lock()

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    def run(self) -> None:
        with self._lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()


class Term:
    """A term of a lease, acquired when the ``with`` block is entered
    (or by :meth:`acquire`) and renewed in a background thread until it is
    released, as the block is left::

        with client.hold("orders", holder="w1", ttl=10.0) as term:
            term.check()                  # LeaseLost once it is lost
            put(..., headers=term.headers())

    ``lost`` is a :class:`threading.Event` set when the term is lost;
    ``on_lost`` (if given) is called once with the reason, from the thread
    that found the loss (the renewer, or one calling :meth:`check`).
    """

    def __init__(
        self,
        client: Client,
        lease: str,
        holder: str,
        ttl: float,
        wait: float = 0.0,
        margin: float | None = None,
        on_lost: Callable[[str], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._client = client
        self._args = (holder, ttl, wait)
        self._margin = _margin(ttl, margin)
        self.lease = lease
        self.holder = holder
        self.token = 0
        self.lease_id = ""
        self.ttl = ttl
        self.lost = threading.Event()
        self._loss = _Loss(on_lost)
        self._clock: Clock = clock or SystemClock()
        self._schedule: _Schedule | None = None
        self._stop = threading.Event()
        self._acquiring = False
        self._released = False
        self._release_lock = threading.Lock()
        self._on_release = _Released()
        self._thread = threading.Thread(
            target=self._run, name=f"fencegate-renew-{lease}", daemon=True
        )

    def acquire(self) -> Term:
        """Acquires the lease (waiting up to ``wait``) and starts renewing
        the term; returns the term. Once only; a term released while it
        was being acquired gives the grant back and raises
        :class:`~fencegate.LeaseLost`."""
        with self._release_lock:
            if self._acquiring or self._released:
                raise FencegateError("a term is acquired once")
            self._acquiring = True
        client, clock = self._client, self._clock
        holder, ttl, wait = self._args
        sent = clock.monotonic()
        grant = client.acquire(self.lease, holder, ttl, wait)
        if _Schedule.fresh_start(grant, sent, clock.monotonic()):
            sent = clock.monotonic()
            try:
                grant = client.renew(self.lease, grant.token, grant.lease_id)
            except BaseException:
                with contextlib.suppress(Exception):
                    client.release(self.lease, grant.token, grant.lease_id)
                raise
        with self._release_lock:
            if not self._released:
                self.holder, self.token, self.lease_id, self.ttl = (
                    grant.holder,
                    grant.token,
                    grant.lease_id,
                    grant.ttl,
                )
                margin = grant.ttl / 10 if self._margin is None else self._margin
                self._schedule = _Schedule(grant, sent, margin)
                self._thread.start()
                return self
        _quietly(client.release, self.lease, grant.token, grant.lease_id)
        raise LeaseLost("the term was released while it was being acquired")

    # -- what the holder asks --------------------------------------------

    @property
    def lost_reason(self) -> str | None:
        """Why the term is lost, or ``None`` while it is held."""
        return self._loss.reason

    def check(self) -> None:
        """Raises :class:`~fencegate.LeaseLost` unless the term is held
        right now: acquired, not released, not lost, its local deadline not
        passed (read from the clock here, whatever the renewer is doing:
        after a suspend, at once), and its renewer alive."""
        if self._released:
            raise LeaseLost("the term was released")
        s = self._schedule
        if s is None:
            raise LeaseLost("the term is not held yet: enter it first (with)")
        if self._loss.reason is None:
            if self._clock.monotonic() >= s.deadline:
                self._lose(_PAST_DEADLINE)
            elif not self._thread.is_alive():
                self._lose("the renewer stopped")
        reason = self._loss.reason
        if reason is not None:
            raise LeaseLost(reason)

    def headers(self) -> dict[str, str]:
        """The fencing headers of the term, for any HTTP client. Raises
        :class:`~fencegate.LeaseLost` instead once it is lost."""
        self.check()
        return {FENCING_TOKEN: str(self.token), FENCING_LEASE_ID: self.lease_id}

    def on_release(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the term is released (at once if it
        was): a client fenced under the term (:func:`fencegate.boto3.fence`)
        lets go of it then."""
        self._on_release.add(callback)

    def release(self) -> None:
        """Stops renewing and releases the term, once: a second call does
        nothing. A term lost to a refused renewal is over at fencegate and
        is not released; one lost otherwise is, at best effort."""
        with self._release_lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        try:
            s = self._schedule
            if s is None:
                return
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                # A renewal in flight gives up at the local deadline.
                left = s.deadline - self._clock.monotonic()
                self._thread.join(timeout=max(0.0, left) + self._client.transport.timeout)
            _release(self._client, self.lease, self.token, self.lease_id, self._loss)
        finally:
            self._on_release.run()

    def __enter__(self) -> Term:
        if not self._acquiring:
            self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- the renewer ------------------------------------------------------

    def _lose(self, reason: str, refused: bool = False) -> None:
        if self._loss.lose(reason, refused):
            self.lost.set()

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
        assert s is not None
        clock = self._clock
        while True:
            if clock.wait(self._stop, s.wait(clock.monotonic())):
                return
            sent = clock.monotonic()
            due = s.due(sent)
            if due:
                self._lose(due)
                return
            if due is None:
                continue
            try:
                grant = s.renewal(
                    self._client, self.lease, self.token, self.lease_id, clock, sent
                )()
            except (ProblemError, Unreachable) as e:
                if self._stop.is_set():
                    return  # released meanwhile
                lost = s.failed(e, clock.monotonic())
                if lost is not None:
                    self._lose(*lost)
                    return
                continue
            if self._stop.is_set() or self._loss.reason is not None:
                return  # released, or lost meanwhile (check() saw the deadline)
            s.renewed(grant, sent)


class AsyncTerm:
    """:class:`Term` for asyncio::

        async with client.hold_async("orders", holder="w1", ttl=10.0) as term:
            term.check()

    The renewer is a task on the running loop (each renewal runs in a
    thread, as the calls are blocking); ``lost`` is an :class:`asyncio.Event`.
    :meth:`check` and :meth:`headers` may be called from any thread (a
    fenced call run with :func:`asyncio.to_thread`).
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
        self._margin = _margin(ttl, margin)
        self._loss = _Loss(on_lost)
        self.lost = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released = False
        self._on_release = _Released()
        self._task: asyncio.Task[None] | None = None
        self._schedule: _Schedule | None = None
        self.lease = lease
        self.token = 0
        self.lease_id = ""

    async def __aenter__(self) -> AsyncTerm:
        if self._loop is not None or self._released:
            raise FencegateError("a term is acquired once")
        self._loop = asyncio.get_running_loop()
        clock = self._clock
        client = self._client
        lease, holder, ttl, wait = self._args
        sent = clock.monotonic()
        acquiring = asyncio.ensure_future(
            asyncio.to_thread(client.acquire, lease, holder, ttl, wait)
        )
        try:
            grant = await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            # Cancelled while acquiring: a term granted anyway is released.
            def release(done: asyncio.Future[Grant]) -> None:
                if done.cancelled() or done.exception() is not None:
                    return
                g = done.result()
                threading.Thread(
                    target=lambda: _quietly(client.release, lease, g.token, g.lease_id),
                    daemon=True,
                ).start()

            acquiring.add_done_callback(release)
            raise
        if _Schedule.fresh_start(grant, sent, clock.monotonic()):
            sent = clock.monotonic()
            try:
                grant = await asyncio.to_thread(client.renew, lease, grant.token, grant.lease_id)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(client.release, lease, grant.token, grant.lease_id)
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
        return self._loss.reason

    def _lose(self, reason: str, refused: bool = False) -> None:
        if not self._loss.lose(reason, refused):
            return
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop:
            self.lost.set()
        else:
            loop.call_soon_threadsafe(self.lost.set)

    def check(self) -> None:
        """As :meth:`Term.check`."""
        if self._released:
            raise LeaseLost("the term was released")
        s = self._schedule
        if s is None:
            raise LeaseLost("the term is not held yet: enter it first (async with)")
        if self._loss.reason is None:
            if self._clock.monotonic() >= s.deadline:
                self._lose(_PAST_DEADLINE)
            elif self._task is not None and self._task.done():
                self._lose("the renewer stopped")
        reason = self._loss.reason
        if reason is not None:
            raise LeaseLost(reason)

    def headers(self) -> dict[str, str]:
        """As :meth:`Term.headers`."""
        self.check()
        return {FENCING_TOKEN: str(self.token), FENCING_LEASE_ID: self.lease_id}

    def on_release(self, callback: Callable[[], None]) -> None:
        """As :meth:`Term.on_release`."""
        self._on_release.add(callback)

    async def release(self) -> None:
        """As :meth:`Term.release`."""
        if self._released:
            return
        self._released = True
        try:
            if self._task is not None:
                self._task.cancel()
                # Waits for the renewer without taking on its cancellation
                # (a cancellation of the caller still reaches the caller).
                await asyncio.wait({self._task})
            if self._schedule is not None:
                await asyncio.to_thread(
                    _release, self._client, self.lease, self.token, self.lease_id, self._loss
                )
        finally:
            self._on_release.run()

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
            await clock.sleep(s.wait(clock.monotonic()))
            sent = clock.monotonic()
            due = s.due(sent)
            if due:
                self._lose(due)
                return
            if due is None:
                continue
            try:
                grant = await asyncio.to_thread(
                    s.renewal(self._client, self.lease, self.token, self.lease_id, clock, sent)
                )
            except (ProblemError, Unreachable) as e:
                lost = s.failed(e, clock.monotonic())
                if lost is not None:
                    self._lose(*lost)
                    return
                continue
            if self._loss.reason is not None:
                return  # lost meanwhile (check() saw the deadline)
            s.renewed(grant, sent)


def _release(client: Client, lease: str, token: int, lease_id: str, loss: _Loss) -> None:
    """Releases a term on leaving it. A term lost to a refused renewal is
    over at fencegate: nothing is sent. One lost otherwise is released at
    best effort; a held one's failure to release is raised, unless
    fencegate had already ended it (expired, superseded)."""
    if loss.refused:
        return
    try:
        client.release(lease, token, lease_id)
    except ProblemError as e:
        if e.reason not in _ENDED and loss.reason is None:
            raise
    except FencegateError:
        if loss.reason is None:
            raise


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(Exception):
        call(*args)
