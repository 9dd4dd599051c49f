"""The rules of holding a term, each proved: renew at TTL/3; a refused
renewal, a passed deadline and a dead renewer are losses; check() raises
once lost; release once. Time is a manual clock the test moves (the
renewer's waits and deadlines read it), so nothing here waits on real time
for a lease."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Servers, advance, raw
from test_api import GRANT, member

import fencegate
from fencegate.client import Grant
from fencegate.term import AsyncTerm, Term

# A renewer that dies prints its exception (as a thread's should); here it
# is the point of the test.
thread_exception = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)


class ManualClock:
    """Monotonic time that moves only when the test says. The renewer
    parks in wait(); `advance` moves time and returns once the renewer is
    parked waiting for a later time (or has stopped)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cond = threading.Condition()
        self.parked_until: float | None = None
        self.frozen = False

    def monotonic(self) -> float:
        with self.cond:
            return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        with self.cond:
            until = self.now + max(0.0, timeout)
            self.parked_until = float("inf") if self.frozen else until
            self.cond.notify_all()
            # Polls only to see `event` set by another thread.
            while not event.is_set() and (self.frozen or self.now < until):
                self.cond.wait(0.005)
            self.parked_until = None
            return event.is_set()

    def advance(self, seconds: float, renewer: threading.Thread | None = None) -> None:
        with self.cond:
            self.now += seconds
            self.cond.notify_all()
            if renewer is None:
                return
            # Bounded real-time wait for the renewer thread to act on the
            # new time and park again (or end).
            limit = time.monotonic() + 30
            while renewer.is_alive() and not (
                self.parked_until is not None and self.parked_until > self.now
            ):
                assert time.monotonic() < limit, "the renewer did not park"
                self.cond.wait(0.005)


class FakeClient:
    """The calls a Term makes, answered as told, recorded with the time."""

    def __init__(self, clock: ManualClock | ManualAsyncClock, ttl: float = 9.0) -> None:
        self.clock = clock
        self.ttl = ttl
        self.renewals: list[float] = []
        self.releases = 0
        self.answer: Any = None  # an exception to raise on renew, or None
        self.acquires = 0
        self.transport = SimpleNamespace(timeout=5.0)

    def grant(self) -> Grant:
        return Grant("orders", "w1", 7, "id-7", self.ttl, self.ttl)

    def acquire(self, lease: str, holder: str, ttl: float, wait: float) -> Grant:
        self.acquires += 1
        return self.grant()

    def renew(
        self,
        lease: str,
        token: int,
        lease_id: str,
        ttl: Any = None,
        *,
        timeout: Any = None,
        budget: Any = None,
    ) -> Grant:
        self.renewals.append(self.clock.monotonic())
        if self.answer is not None:
            raise self.answer
        return self.grant()

    def release(self, lease: str, token: int, lease_id: str) -> None:
        self.releases += 1


def hold(clock: ManualClock, client: Any, **kw: Any) -> Term:
    term = Term(client, "orders", "w1", client.ttl, 0.0, None, None, clock=clock, **kw).acquire()
    clock.advance(0, term._thread)
    return term


def test_renews_every_third_of_the_ttl() -> None:
    clock = ManualClock()
    client = FakeClient(clock, ttl=9.0)
    term = hold(clock, client)
    clock.advance(2.9, term._thread)
    assert client.renewals == []
    clock.advance(0.1, term._thread)
    assert client.renewals == [3.0]
    for _ in range(3):
        clock.advance(3.0, term._thread)
    assert client.renewals == [3.0, 6.0, 9.0, 12.0]
    term.check()
    assert not term.lost.is_set()
    term.release()


def test_a_refused_renewal_is_a_loss() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    seen: list[str] = []
    term = Term(client, "orders", "w1", 9.0, 0.0, None, seen.append, clock=clock).acquire()
    clock.advance(0, term._thread)
    client.answer = fencegate.ProblemError(412, "stale-fencing-token", "", None, {})
    clock.advance(3.0, term._thread)
    assert term.lost.is_set() and not term._thread.is_alive()
    assert seen == ["a renewal was refused (stale-fencing-token)"]
    with pytest.raises(fencegate.LeaseLost, match="refused"):
        term.check()
    with pytest.raises(fencegate.LeaseLost):
        term.headers()
    term.release()
    assert client.releases == 0, "a lost term is not released"


def test_no_renewal_before_the_local_deadline_is_a_loss() -> None:
    clock = ManualClock()
    client = FakeClient(clock, ttl=9.0)
    term = hold(clock, client)
    client.answer = fencegate.Unreachable("down")
    clock.advance(3.0, term._thread)
    assert client.renewals == [3.0]
    # Retried, still held until the deadline: sent at 0, expires_in 9 s,
    # margin a tenth of the TTL.
    clock.advance(5.0, term._thread)
    term.check()
    clock.advance(0.1, term._thread)
    assert term.lost.is_set()
    with pytest.raises(fencegate.LeaseLost, match="deadline"):
        term.check()


def test_the_deadline_counts_from_when_the_renewal_was_sent() -> None:
    clock = ManualClock()
    client = FakeClient(clock, ttl=9.0)
    term = hold(clock, client)

    # A renewal that takes 2.5 s to answer: the term's new deadline is 9 s
    # after it was sent (minus the margin), not after it was answered.
    def slow(*args: Any, **kwargs: Any) -> Grant:
        client.renewals.append(clock.monotonic())
        with clock.cond:
            clock.now += 2.5
        client.answer = fencegate.Unreachable("down from now on")
        return client.grant()

    client.renew = slow  # type: ignore[method-assign]
    clock.advance(3.0, term._thread)
    assert client.renewals == [3.0] and clock.now == 5.5
    del client.renew
    clock.advance(5.5, term._thread)  # 11.0 < 3 + 9 - 0.9
    term.check()
    clock.advance(0.1, term._thread)
    with pytest.raises(fencegate.LeaseLost, match="deadline"):
        term.check()


def test_a_frozen_renewer_is_caught_by_check() -> None:
    clock = ManualClock()
    client = FakeClient(clock, ttl=9.0)
    term = hold(clock, client)
    # The renewer never wakes (a stuck thread, a process paused whole):
    # check() reads the clock itself.
    clock.frozen = True
    clock.advance(8.0)
    term.check()
    clock.advance(0.1)
    with pytest.raises(fencegate.LeaseLost, match="deadline"):
        term.check()
    assert term.lost.is_set() and client.renewals == []
    clock.frozen = False
    term.release()


@thread_exception
def test_a_renewer_that_dies_is_a_loss() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    term = hold(clock, client)
    client.answer = RuntimeError("a bug in the renewer")
    clock.advance(3.0, term._thread)
    assert not term._thread.is_alive()
    with pytest.raises(fencegate.LeaseLost, match="renewer failed"):
        term.check()


def kill(thread: threading.Thread) -> None:
    """Raises SystemExit inside `thread`: it ends as a killed thread does."""
    assert thread.ident is not None
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
    )
    assert n == 1


@thread_exception
def test_a_killed_renewer_is_a_loss() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    term = hold(clock, client)
    kill(term._thread)
    term._thread.join(30)
    assert not term._thread.is_alive()
    assert term.lost.is_set()
    with pytest.raises(fencegate.LeaseLost, match="renewer"):
        term.check()


def test_a_renewer_that_returns_is_a_loss() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    seen: list[str] = []
    term = Term(client, "orders", "w1", 9.0, 0.0, None, seen.append, clock=clock).acquire()
    clock.advance(0, term._thread)
    # A wait that wrongly reports the stop signal: the loop ends quietly.
    clock.wait = lambda event, timeout: True  # type: ignore[method-assign]
    clock.advance(3.0, term._thread)
    term._thread.join(30)
    assert term.lost.is_set() and seen == ["the renewer stopped"]


def test_a_term_lost_while_a_renewal_is_in_flight_is_never_renewed_again() -> None:
    clock = ManualClock()
    client = FakeClient(clock, ttl=9.0)
    term = hold(clock, client)
    entered, answer = threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Grant:
        client.renewals.append(clock.monotonic())
        entered.set()
        assert answer.wait(30)
        return client.grant()

    client.renew = slow  # type: ignore[method-assign]
    clock.advance(3.0)
    assert entered.wait(30)
    # The renewal hangs past the deadline; the holder's check finds it.
    clock.advance(6.0)
    with pytest.raises(fencegate.LeaseLost, match="deadline"):
        term.check()
    answer.set()  # then fencegate renews after all: too late to count
    term._thread.join(30)
    assert not term._thread.is_alive() and client.renewals == [3.0]
    with pytest.raises(fencegate.LeaseLost):
        term.check()
    # Lost here, not at fencegate: released, so the next holder need not
    # wait for it to expire.
    term.release()
    assert client.releases == 1


def test_a_margin_that_would_outlive_fencegate_s_deadline_is_refused() -> None:
    client = FakeClient(ManualClock())
    for margin in (-0.1, 6.0):
        with pytest.raises(ValueError, match="margin"):
            Term(client, "orders", "w1", 9.0, 0.0, margin, None, clock=ManualClock())


def test_released_once_never_twice() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    with hold(clock, client) as term:
        term.release()
        term.release()
        with pytest.raises(fencegate.LeaseLost, match="released"):
            term.check()
    assert client.releases == 1
    assert not term._thread.is_alive()


def test_a_term_is_acquired_when_its_block_is_entered() -> None:
    # As kazoo's Lock and the async flavour: making the term asks nothing
    # of fencegate; entering the block acquires, leaving it releases.
    # Nothing listens at port 9: a hold() that acquired would raise.
    unheld = fencegate.Client("http://127.0.0.1:9").hold("orders", "w1", 9.0)
    with pytest.raises(fencegate.LeaseLost, match="not held yet"):
        unheld.headers()
    clock = ManualClock()
    client = FakeClient(clock)
    term = Term(client, "orders", "w1", 9.0, clock=clock)  # type: ignore[arg-type]
    assert client.acquires == 0
    with pytest.raises(fencegate.LeaseLost, match="not held yet"):
        term.check()
    with term as held:
        assert client.acquires == 1 and held.token == 7
        held.check()
    assert client.releases == 1
    with pytest.raises(fencegate.FencegateError, match="once"):
        term.acquire()


def test_a_term_released_while_it_is_acquired_gives_the_grant_back() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    granting, go_on = threading.Event(), threading.Event()
    grant = client.acquire

    def slow_acquire(*args: Any) -> Grant:
        granting.set()
        assert go_on.wait(30)
        return grant(*args)

    client.acquire = slow_acquire  # type: ignore[method-assign]
    term = Term(client, "orders", "w1", 9.0, clock=clock)  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def enter() -> None:
        try:
            term.acquire()
        except BaseException as e:
            raised.append(e)

    acquiring = threading.Thread(target=enter)
    acquiring.start()
    assert granting.wait(30)
    term.release()
    go_on.set()
    acquiring.join(30)
    assert [type(e) for e in raised] == [fencegate.LeaseLost]
    assert client.releases == 1, "the grant that came after the release is given back"
    assert not term._thread.is_alive()


def test_what_a_term_holds_is_let_go_when_it_is_released() -> None:
    clock = ManualClock()
    client = FakeClient(clock)
    let_go: list[str] = []
    with hold(clock, client) as term:
        term.on_release(lambda: let_go.append("hooks"))
        assert let_go == []
    assert let_go == ["hooks"]
    # Added once released: at once.
    term.on_release(lambda: let_go.append("late"))
    assert let_go == ["hooks", "late"]


# -- the default clock counts suspend -------------------------------------

boottime = pytest.mark.skipif(
    not hasattr(time, "CLOCK_BOOTTIME"), reason="no CLOCK_BOOTTIME on this platform"
)


class Suspend:
    """A suspend of the machine, simulated: ``CLOCK_BOOTTIME`` runs on by
    ``seconds`` while ``CLOCK_MONOTONIC`` (``time.monotonic()``, the
    timers, asyncio's loop time) stands still, as across a real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seconds = 0.0
        real = time.clock_gettime

        def clock_gettime(clock_id: int) -> float:
            t = real(clock_id)
            return t + self.seconds if clock_id == time.CLOCK_BOOTTIME else t

        monkeypatch.setattr(time, "clock_gettime", clock_gettime)


# This test and the next were seen failing against the old clocks
# (MonotonicClock and LoopClock read time.monotonic(), which stands still
# in a suspend): "DID NOT RAISE LeaseLost", the term still held after it.
@boottime
def test_a_deadline_that_passed_while_the_machine_was_suspended_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    suspend = Suspend(monkeypatch)
    client = FakeClient(ManualClock(), ttl=9.0)
    # The default clock; the renewer waits (real time) for its first
    # renewal, 3 s away, and is released long before.
    term = Term(client, "orders", "w1", 9.0, 0.0, None, None).acquire()
    term.check()
    suspend.seconds = 60.0  # past the local deadline, 8.1 s after the acquire
    with pytest.raises(fencegate.LeaseLost, match="deadline"):
        term.check()
    assert term.lost.is_set() and client.renewals == []
    term.release()
    assert client.releases == 1, "lost here, not at fencegate: released"


@boottime
def test_async_a_deadline_that_passed_while_the_machine_was_suspended_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    suspend = Suspend(monkeypatch)

    async def run() -> None:
        client = FakeClient(ManualAsyncClock(), ttl=9.0)
        async with AsyncTerm(client, "orders", "w1", 9.0, 0.0, None, None) as term:
            term.check()
            suspend.seconds = 60.0
            # From the loop and from another thread alike.
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                await asyncio.to_thread(term.check)
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                term.headers()
            assert client.renewals == []
        assert client.releases == 1

    asyncio.run(run())


# -- against the real binary --------------------------------------------


def test_a_held_term_against_fencegate(servers: Servers) -> None:
    fg = servers.fencegate()
    client = fencegate.Client(fg.url)
    clock = ManualClock()
    term = Term(client, "orders", "w1", 3.0, 0.0, None, None, clock=clock).acquire()
    clock.advance(0, term._thread)
    status, _ = raw("PUT", f"{fg.url}/kv/orders/1", b"v1", term.headers())
    assert status == 201
    # Both clocks move a TTL on, a third at a time: renewed each time.
    for _ in range(6):
        advance(fg.url, 1000)
        clock.advance(1.0, term._thread)
    term.check()
    assert client.show("orders")["token"] == 1
    status, _ = raw("PUT", f"{fg.url}/kv/orders/1", b"v2", term.headers())
    assert status == 204
    with term:
        pass
    assert client.show("orders")["state"] == "released"


def test_a_term_fencegate_refuses_to_renew_is_lost_and_its_write_refused(
    servers: Servers,
) -> None:
    fg = servers.fencegate()
    client = fencegate.Client(fg.url)
    clock = ManualClock()
    a = Term(client, "orders", "A", 3.0, 0.0, None, None, clock=clock).acquire()
    clock.advance(0, a._thread)
    stale = a.headers()
    # fencegate's clock runs the term out; B takes the lease.
    advance(fg.url, 3000)
    b = client.acquire("orders", "B", ttl=3.0)
    b_headers = {"Fencing-Token": str(b.token), "Fencing-Lease-Id": b.lease_id}
    assert raw("PUT", f"{fg.url}/kv/orders/1", b"B's", b_headers)[0] == 201
    clock.advance(1.0, a._thread)
    assert a.lost_reason == "a renewal was refused (stale-fencing-token)"
    with pytest.raises(fencegate.LeaseLost):
        a.headers()
    # The write a zombie would send anyway is refused at the storage's door.
    status, body = raw("PUT", f"{fg.url}/kv/orders/1", b"A's", stale)
    assert status == 412 and b"stale-fencing-token" in body
    assert raw("GET", f"{fg.url}/kv/orders/1")[1] == b"B's"
    a.release()
    assert client.show("orders")["holder"] == "B", "a lost term is not released"


# -- asyncio --------------------------------------------------------------


class ManualAsyncClock:
    """ManualClock for the asyncio renewer."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleepers: list[tuple[float, asyncio.Future[None]]] = []
        self.frozen = False

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        until = self.now + max(0.0, seconds)
        if until <= self.now:
            await asyncio.sleep(0)
            return
        done = asyncio.get_running_loop().create_future()
        entry = (until, done)
        self.sleepers.append(entry)
        try:
            await done
        finally:
            self.sleepers.remove(entry)

    async def advance(self, seconds: float, term: AsyncTerm) -> None:
        self.now += seconds
        if self.frozen:
            return
        for until, done in self.sleepers:
            if until <= self.now and not done.done():
                done.set_result(None)
        # The renewer's calls run in threads: wait (bounded, real time) for
        # it to sleep until a later time, or end.
        task = term._task
        assert task is not None
        limit = time.monotonic() + 30
        while not task.done() and not any(u > self.now for u, _ in self.sleepers):
            assert time.monotonic() < limit, "the renewer did not park"
            await asyncio.sleep(0.001)


def async_hold(clock: ManualAsyncClock, client: Any, seen: list[str]) -> AsyncTerm:
    return AsyncTerm(client, "orders", "w1", client.ttl, 0.0, None, seen.append, clock)


def test_async_renews_every_third_and_a_refusal_is_a_loss() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)
        seen: list[str] = []
        async with async_hold(clock, client, seen) as term:
            await clock.advance(0, term)
            await clock.advance(2.9, term)
            assert client.renewals == []
            await clock.advance(0.1, term)
            for _ in range(2):
                await clock.advance(3.0, term)
            assert client.renewals == [3.0, 6.0, 9.0]
            term.check()
            client.answer = fencegate.ProblemError(409, "lease-released", "", None, {})
            await clock.advance(3.0, term)
            assert term.lost.is_set() and seen == ["a renewal was refused (lease-released)"]
            with pytest.raises(fencegate.LeaseLost):
                term.headers()
        assert client.releases == 0

    asyncio.run(run())


def test_async_no_renewal_before_the_deadline_is_a_loss() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)
        client.answer = fencegate.Unreachable("down")
        async with async_hold(clock, client, []) as term:
            await clock.advance(8.0, term)
            term.check()
            await clock.advance(0.1, term)
            assert term.lost.is_set()
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                term.check()

    asyncio.run(run())


def test_async_the_deadline_counts_from_when_the_renewal_was_sent() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)

        def slow(*args: Any, **kwargs: Any) -> Grant:
            client.renewals.append(clock.monotonic())
            clock.now += 2.5
            client.answer = fencegate.Unreachable("down from now on")
            return client.grant()

        async with async_hold(clock, client, []) as term:
            client.renew = slow  # type: ignore[method-assign]
            await clock.advance(3.0, term)
            assert client.renewals == [3.0] and clock.now == 5.5
            del client.renew
            await clock.advance(5.5, term)  # 11.0 < 3 + 9 - 0.9
            term.check()
            await clock.advance(0.1, term)
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                term.check()

    asyncio.run(run())


def test_async_a_frozen_renewer_is_caught_by_check() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)
        async with async_hold(clock, client, []) as term:
            await clock.advance(0, term)
            clock.frozen = True
            await clock.advance(8.0, term)
            term.check()
            await clock.advance(0.1, term)
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                term.check()
            assert client.renewals == []

    asyncio.run(run())


def test_async_a_renewer_that_dies_or_is_cancelled_is_a_loss() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)
        client.answer = RuntimeError("a bug")
        async with async_hold(clock, client, []) as term:
            await clock.advance(3.0, term)
            with pytest.raises(fencegate.LeaseLost, match="renewer failed"):
                term.check()
        client.answer = None
        seen: list[str] = []
        async with async_hold(clock, client, seen) as term:
            await clock.advance(0, term)
            assert term._task is not None
            term._task.cancel()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert term.lost.is_set() and seen == ["the renewer stopped"]
        # Lost here, not refused at fencegate: each released on leaving.
        assert client.releases == 2

    asyncio.run(run())


def test_async_check_works_from_another_thread_and_not_before_entering() -> None:
    async def run() -> None:
        client = FakeClient(ManualAsyncClock())
        term = AsyncTerm(client, "orders", "w1", 9.0, 0.0, None, None)
        with pytest.raises(fencegate.LeaseLost, match="not held yet"):
            term.headers()
        async with term:
            # As a fenced call run with asyncio.to_thread checks it.
            headers = await asyncio.to_thread(term.headers)
            assert headers["Fencing-Token"] == "7"

    asyncio.run(run())


def test_async_a_term_granted_after_its_acquire_was_cancelled_is_released() -> None:
    granting = threading.Event()

    class Slow(FakeClient):
        def acquire(self, lease: str, holder: str, ttl: float, wait: float) -> Grant:
            assert granting.wait(30)
            return self.grant()

    client = Slow(ManualAsyncClock())
    released = threading.Event()
    client.release = lambda *args: released.set()  # type: ignore[method-assign]

    async def run() -> None:
        entering = asyncio.create_task(async_hold(ManualAsyncClock(), client, []).__aenter__())
        await asyncio.sleep(0.01)
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        granting.set()  # the acquire was under way: fencegate grants it
        assert await asyncio.to_thread(released.wait, 30)

    asyncio.run(run())


def test_async_a_term_lost_while_a_renewal_is_in_flight_is_never_renewed_again() -> None:
    answer = threading.Event()

    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock, ttl=9.0)

        def slow(*args: Any, **kwargs: Any) -> Grant:
            client.renewals.append(clock.monotonic())
            assert answer.wait(30)
            return client.grant()

        client.renew = slow  # type: ignore[method-assign]
        async with async_hold(clock, client, []) as term:
            await clock.advance(0, term)
            clock.now = 3.0
            for until, done in clock.sleepers:
                if until <= 3.0:
                    done.set_result(None)
            limit = time.monotonic() + 30
            while not client.renewals:  # real time, bounded
                assert time.monotonic() < limit, "no renewal at a third of the TTL"
                await asyncio.sleep(0.001)
            clock.now = 9.0  # the renewal hangs past the deadline
            with pytest.raises(fencegate.LeaseLost, match="deadline"):
                term.check()
            answer.set()
            assert term._task is not None
            await asyncio.wait_for(asyncio.wait({term._task}), 30)
            assert client.renewals == [3.0]
        assert client.releases == 1

    asyncio.run(run())


def test_async_released_once_never_twice() -> None:
    async def run() -> None:
        clock = ManualAsyncClock()
        client = FakeClient(clock)
        async with async_hold(clock, client, []) as term:
            await term.release()
            await term.release()
            with pytest.raises(fencegate.LeaseLost, match="released"):
                term.check()
        assert client.releases == 1

    asyncio.run(run())


def test_async_a_held_term_against_fencegate(servers: Servers) -> None:
    fg = servers.fencegate()
    client = fencegate.Client(fg.url)

    async def run() -> None:
        async with client.hold_async("orders", holder="w1", ttl=30.0) as term:
            status, _ = await asyncio.to_thread(
                raw, "PUT", f"{fg.url}/kv/orders/1", b"v1", term.headers()
            )
            assert status == 201
        assert client.show("orders")["state"] == "released"

    asyncio.run(run())


def test_a_renewal_gives_up_at_the_local_deadline() -> None:
    # A member that grants, then answers every renewal "not primary" with
    # no primary named (a cluster between primaries): the renewer tries
    # again and again, but not past the term's local deadline.
    def answer(h: Any) -> tuple[int, dict[str, Any]]:
        if h.path.endswith("/renew"):
            return 503, {"reason": "not-primary", "status": 503, "primary": None}
        return 201, {**GRANT, "ttl_ms": 9000, "expires_in_ms": 9000}

    clock = ManualClock()
    with member(answer) as (url, m):
        term = Term(
            fencegate.Client(url), "orders", "A", 9.0, 0.0, None, None, clock=clock
        ).acquire()
        clock.advance(0, term._thread)
        renewals = lambda: sum(1 for hit in m.hits if hit.endswith("/renew"))  # noqa: E731
        clock.advance(3.0)
        limit = time.monotonic() + 30
        while renewals() < 2:  # real time, bounded: the renewer's attempts
            assert time.monotonic() < limit
            time.sleep(0.01)
        clock.advance(5.5)  # past the deadline, 9 - 0.9 s after the acquire
        tried = renewals()
        term._thread.join(30)
        assert not term._thread.is_alive()
    assert term.lost_reason == "no renewal succeeded before the local deadline"
    assert renewals() <= tried + 1, "the renewal went on past the deadline"
