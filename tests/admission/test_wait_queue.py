"""PriorityWaitQueue: order, fairness, timeouts, cancellation, bounds, shedding, invariants.

Capacity is a small fake counter (``Capacity``) whose ``try_admit`` hands out ``Ticket``s;
releasing a ticket calls ``queue.notify()`` like the gateway does after ``Reservation.release``.
Deadlines are driven by a manual clock patched into the loop (aiolimiter's ``MockLoopTime``
idea), so no test sleeps for a timeout except one small real-time check.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.admission.wait_queue import (
    PRIORITY_CLASSES,
    PriorityWaitQueue,
    QueueFull,
    QueueRejected,
    Shed,
    WaitTimeout,
)


class Ticket:
    """A fake reservation of ``size`` units of capacity."""

    def __init__(self, cap: Capacity, name: str, size: int = 1) -> None:
        self.cap = cap
        self.name = name
        self.size = size
        self.released = False

    def release(self) -> None:
        assert not self.released, "released twice"
        self.released = True
        self.cap.in_use -= self.size
        if self.cap.queue is not None:
            self.cap.queue.notify()


class Capacity:
    """A concurrency limit of ``limit`` units; records every try_admit call and admission."""

    def __init__(self, limit: int, queue: PriorityWaitQueue[Ticket] | None = None) -> None:
        self.limit = limit
        self.in_use = 0
        self.queue = queue
        self.calls: list[str] = []
        self.admitted: list[str] = []

    def admitter(self, name: str, size: int = 1) -> Callable[[], Ticket | None]:
        def try_admit() -> Ticket | None:
            self.calls.append(name)
            if self.in_use + size <= self.limit:
                self.in_use += size
                self.admitted.append(name)
                return Ticket(self, name, size)
            return None

        return try_admit

    def grow(self, by: int = 1) -> None:
        self.limit += by
        assert self.queue is not None
        self.queue.notify()


async def settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def make(limit: int, *, max_waiters: int = 100, **kw):
    q: PriorityWaitQueue[Ticket] = PriorityWaitQueue(max_waiters=max_waiters, **kw)
    return q, Capacity(limit, q)


def spawn(q, cap, name, *, tenant="t", priority="standard", max_wait=60.0, size=1, backend=None):
    return asyncio.create_task(
        q.wait(
            tenant=tenant,
            priority=priority,
            max_wait=max_wait,
            try_admit=cap.admitter(name, size),
            backend=backend,
        )
    )


class ManualClock:
    """Replaces ``loop.time`` so loop timers (the waiters' deadlines) follow it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def manual_clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock()
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "time", clock)
    return clock


# ---------------------------------------------------------------------------- basic behaviour


async def test_admits_at_once_when_capacity_is_free() -> None:
    waits: list[tuple[str, float]] = []
    q, cap = make(1, on_wait=lambda c, s: waits.append((c, s)))
    ticket = await q.wait(
        tenant="a", priority="standard", max_wait=1.0, try_admit=cap.admitter("x")
    )
    assert isinstance(ticket, Ticket)
    assert ticket.name == "x"
    assert len(q) == 0
    assert waits == []  # only queued waiters are observed


async def test_max_wait_zero_refuses_at_once_without_queueing() -> None:
    q, cap = make(0)
    with pytest.raises(WaitTimeout, match="max_wait=0") as info:
        await q.wait(tenant="a", priority="critical", max_wait=0, try_admit=cap.admitter("x"))
    assert info.value.max_wait == 0.0
    assert info.value.priority == "critical"
    assert isinstance(info.value, QueueRejected)
    assert len(q) == 0
    assert cap.calls == ["x"]


async def test_order_across_classes() -> None:
    q, cap = make(0)
    tasks = [
        spawn(q, cap, "shed1", priority="sheddable"),
        spawn(q, cap, "std1", priority="standard"),
        spawn(q, cap, "crit1", priority="critical"),
        spawn(q, cap, "shed2", priority="sheddable"),
        spawn(q, cap, "crit2", priority="critical"),
        spawn(q, cap, "std2", priority="standard"),
    ]
    await settle()
    assert (q.depth("critical"), q.depth("standard"), q.depth("sheddable")) == (2, 2, 2)
    for _ in tasks:
        cap.grow()
        await settle()
    assert cap.admitted == ["crit1", "crit2", "std1", "std2", "shed1", "shed2"]
    assert [t.result().name for t in tasks] == ["shed1", "std1", "crit1", "shed2", "crit2", "std2"]
    assert len(q) == 0


async def test_fifo_within_a_tenant() -> None:
    q, cap = make(1)
    held = await q.wait(tenant="a", priority="standard", max_wait=1, try_admit=cap.admitter("0"))
    tasks = [spawn(q, cap, str(i), tenant="a") for i in range(1, 6)]
    await settle()
    assert q.tenant_depth("a") == 5
    held.release()
    for task in tasks:
        await settle()
        task.result().release()
    assert cap.admitted == ["0", "1", "2", "3", "4", "5"]
    assert cap.in_use == 0


async def test_round_robin_between_tenants_of_one_class() -> None:
    q, cap = make(0)
    flood = [spawn(q, cap, f"a{i}", tenant="flooder") for i in range(6)]
    await settle()
    other = [spawn(q, cap, f"b{i}", tenant="quiet") for i in range(3)]
    await settle()
    for _ in range(len(flood) + len(other)):
        cap.grow()
        await settle()
    assert cap.admitted == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


async def test_round_robin_also_when_one_notify_admits_several() -> None:
    q, cap = make(0)
    for i in range(4):
        spawn(q, cap, f"a{i}", tenant="flooder")
    for i in range(2):
        spawn(q, cap, f"b{i}", tenant="quiet")
    await settle()
    cap.grow(4)
    await settle()
    assert cap.admitted == ["a0", "b0", "a1", "b1"]
    assert q.tenant_depth("flooder") == 2
    assert q.tenant_depth("quiet") == 0
    q.shed("standard")
    await settle()


async def test_notify_admits_exactly_as_many_as_capacity_allows() -> None:
    q, cap = make(0)
    tasks = [spawn(q, cap, f"w{i}") for i in range(5)]
    await settle()
    cap.calls.clear()
    cap.limit = 3
    q.notify()
    # three admissions, then one refused head and a stop: nobody behind it is tried
    assert cap.calls == ["w0", "w1", "w2", "w3"]
    assert cap.admitted == ["w0", "w1", "w2"]
    assert cap.in_use == 3
    assert len(q) == 2
    await settle()
    assert [t.done() for t in tasks] == [True, True, True, False, False]
    q.notify()  # no capacity: only the head is tried
    assert cap.calls[-1] == "w3"
    assert cap.admitted == ["w0", "w1", "w2"]
    for t in tasks[:3]:
        t.result().release()
    await settle()
    assert all(t.done() for t in tasks)
    assert cap.in_use == 2


async def test_strict_order_no_bypass_by_a_smaller_request() -> None:
    q, cap = make(2)
    first = await q.wait(tenant="x", priority="critical", max_wait=1, try_admit=cap.admitter("h"))
    big = spawn(q, cap, "big", priority="sheddable", size=2)
    await settle()
    small = spawn(q, cap, "small", priority="sheddable", size=1)
    await settle()
    # one unit is free, but the big head does not fit, and the small one must not overtake it
    assert cap.in_use == 1
    assert not big.done()
    assert not small.done()
    assert "small" not in cap.calls  # queued behind an equal class: not even tried
    first.release()
    await settle()
    assert big.result().name == "big"
    assert not small.done()
    big.result().release()
    await settle()
    assert small.result().name == "small"


async def test_arrival_queues_behind_equal_class_but_higher_class_tries_first() -> None:
    q, cap = make(0)
    older = spawn(q, cap, "older", priority="standard")
    await settle()
    cap.limit = 1  # capacity appeared without notify(): the newcomer must not take it
    newer = spawn(q, cap, "newer", priority="standard")
    await settle()
    assert "newer" not in cap.calls
    assert q.depth("standard") == 2
    crit = await q.wait(tenant="c", priority="critical", max_wait=1, try_admit=cap.admitter("c"))
    assert crit.name == "c"  # nothing of its class or higher waits: it goes straight in
    crit.release()
    await settle()
    assert older.result().name == "older"
    assert not newer.done()
    older.result().release()
    await settle()
    assert newer.result().name == "newer"


async def test_try_admit_error_goes_to_its_waiter_and_the_queue_goes_on() -> None:
    q, cap = make(0)
    attempts = 0

    def broken() -> Ticket | None:
        nonlocal attempts
        attempts += 1
        if attempts > 1:
            raise RuntimeError("backend vanished")
        return None

    bad = asyncio.create_task(
        q.wait(tenant="a", priority="critical", max_wait=60, try_admit=broken)
    )
    good = spawn(q, cap, "good")
    await settle()
    cap.grow()
    await settle()
    with pytest.raises(RuntimeError, match="backend vanished"):
        bad.result()
    assert good.result().name == "good"
    assert len(q) == 0


# ---------------------------------------------------------------------------- timeouts


async def test_timeout_raises_wait_timeout_at_max_wait(manual_clock: ManualClock) -> None:
    waits: list[tuple[str, float]] = []
    q, cap = make(0, on_wait=lambda c, s: waits.append((c, s)))
    task = spawn(q, cap, "w", priority="sheddable", max_wait=2.0)
    await settle()
    manual_clock.now += 1.9
    await settle()
    assert not task.done()
    assert q.depth("sheddable") == 1
    manual_clock.now += 0.1
    await settle()
    with pytest.raises(WaitTimeout, match=r"max_wait=2s in class sheddable") as info:
        task.result()
    assert info.value.max_wait == 2.0
    assert info.value.tenant == "t"
    assert len(q) == 0
    assert waits == [("sheddable", pytest.approx(2.0))]
    cap.grow()  # a later release does not call the expired waiter's try_admit
    assert cap.calls == ["w"]


async def test_timeout_of_the_head_lets_the_next_one_in(manual_clock: ManualClock) -> None:
    q, cap = make(1)
    held = await q.wait(tenant="a", priority="standard", max_wait=1, try_admit=cap.admitter("0"))
    big = spawn(q, cap, "big", priority="critical", max_wait=1.0, size=2)
    small = spawn(q, cap, "small", priority="standard", max_wait=10.0)
    await settle()
    held.release()  # one unit free: the big critical head does not fit, small waits behind it
    await settle()
    assert not small.done()
    manual_clock.now += 1.0
    await settle()
    assert isinstance(big.exception(), WaitTimeout)
    assert small.result().name == "small"  # woken by the head leaving, no release needed


async def test_timeout_in_real_time_is_near_max_wait() -> None:
    q, cap = make(0)
    start = time.monotonic()
    with pytest.raises(WaitTimeout):
        await q.wait(tenant="a", priority="standard", max_wait=0.05, try_admit=cap.admitter("w"))
    elapsed = time.monotonic() - start
    assert 0.03 <= elapsed < 5.0  # generous: only checks that it waited and then gave up
    assert len(q) == 0


# ---------------------------------------------------------------------------- cancellation


async def test_cancel_leaves_the_queue_at_once_and_holds_nothing() -> None:
    waits: list[tuple[str, float]] = []
    q, cap = make(0, on_wait=lambda c, s: waits.append((c, s)))
    gone = spawn(q, cap, "gone")
    stays = spawn(q, cap, "stays")
    await settle()
    assert len(q) == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(q) == 1
    assert q.depth("standard") == 1
    assert len(waits) == 1
    cap.grow()
    await settle()
    assert stays.result().name == "stays"
    assert cap.calls.count("gone") == 1  # only its first attempt: never tried after leaving
    assert cap.in_use == 1


async def test_cancel_is_seen_by_notify_before_the_task_runs() -> None:
    q, cap = make(0)
    gone = spawn(q, cap, "gone")
    stays = spawn(q, cap, "stays")
    await settle()
    gone.cancel()
    cap.grow()  # synchronous, before the cancelled task has run its cleanup
    assert cap.calls.count("gone") == 1
    assert cap.admitted == ["stays"]
    await settle()
    assert gone.cancelled()
    assert stays.result().name == "stays"
    assert len(q) == 0


async def test_cancel_of_the_head_lets_the_next_one_in() -> None:
    q, cap = make(1)
    big = spawn(q, cap, "big", priority="critical", size=2)
    small = spawn(q, cap, "small", priority="standard")
    await settle()
    assert not small.done()  # one unit free, but the big head does not fit
    big.cancel()
    await settle()
    assert big.cancelled()
    assert small.result().name == "small"


@pytest.mark.parametrize("explicit_release", [False, True])
async def test_cancel_right_after_admission_gives_the_reservation_back(
    explicit_release: bool,
) -> None:
    q, cap = make(1)
    held = await q.wait(tenant="a", priority="standard", max_wait=1, try_admit=cap.admitter("0"))
    released: list[str] = []

    def release(ticket: Ticket) -> None:
        released.append(ticket.name)
        ticket.release()

    racer = asyncio.create_task(
        q.wait(
            tenant="a",
            priority="standard",
            max_wait=60,
            try_admit=cap.admitter("racer"),
            release=release if explicit_release else None,
        )
    )
    behind = spawn(q, cap, "behind")
    await settle()
    held.release()  # notify() admits racer synchronously...
    assert cap.admitted == ["0", "racer"]
    racer.cancel()  # ...and its client goes away before the task resumes
    await settle()
    assert racer.cancelled()
    assert released == (["racer"] if explicit_release else [])
    # the racer's unit went back and was handed on: nothing leaked
    assert behind.result().name == "behind"
    assert cap.in_use == 1
    behind.result().release()
    assert cap.in_use == 0


# ---------------------------------------------------------------------------- bound and shed


async def test_queue_full_refuses_with_503_error() -> None:
    q, cap = make(0, max_waiters=2)
    tasks = [spawn(q, cap, f"w{i}") for i in range(2)]
    await settle()
    with pytest.raises(QueueFull, match=r"wait queue full \(2 waiters\)") as info:
        await q.wait(tenant="b", priority="standard", max_wait=5, try_admit=cap.admitter("x"))
    assert info.value.max_waiters == 2
    assert info.value.tenant == "b"
    assert len(q) == 2
    with pytest.raises(QueueFull):  # a lower class cannot displace anyone either
        await q.wait(tenant="b", priority="sheddable", max_wait=5, try_admit=cap.admitter("y"))
    q.shed("standard")
    await settle()
    assert all(isinstance(t.exception(), Shed) for t in tasks)


async def test_full_queue_higher_class_displaces_newest_lowest_of_the_biggest_tenant() -> None:
    q, cap = make(0, max_waiters=4)
    a0 = spawn(q, cap, "a0", tenant="a", priority="sheddable")
    a1 = spawn(q, cap, "a1", tenant="a", priority="sheddable")
    b0 = spawn(q, cap, "b0", tenant="b", priority="sheddable")
    s0 = spawn(q, cap, "s0", tenant="c", priority="standard")
    await settle()
    crit = spawn(q, cap, "crit", tenant="d", priority="critical")
    await settle()
    with pytest.raises(QueueFull, match="displaced"):
        a1.result()
    assert not a0.done()
    assert not b0.done()
    assert (q.depth("critical"), q.depth("standard"), q.depth("sheddable")) == (1, 1, 2)
    cap.grow(4)
    await settle()
    assert cap.admitted == ["crit", "s0", "a0", "b0"]
    assert [t.result().name for t in (crit, s0, a0, b0)] == ["crit", "s0", "a0", "b0"]


async def test_shed_answers_queued_sheddable_waiters_and_leaves_others() -> None:
    waits: list[tuple[str, float]] = []
    q, cap = make(0, on_wait=lambda c, s: waits.append((c, s)))
    shed = [spawn(q, cap, f"s{i}", tenant=f"t{i % 2}", priority="sheddable") for i in range(3)]
    std = spawn(q, cap, "std", priority="standard")
    crit = spawn(q, cap, "crit", priority="critical")
    await settle()
    assert q.shed() == 3
    assert q.depth("sheddable") == 0
    assert len(q) == 2
    await settle()
    for task in shed:
        with pytest.raises(Shed, match="class sheddable is being shed") as info:
            task.result()
        assert isinstance(info.value, QueueRejected)
    assert not std.done()
    assert not crit.done()
    assert sorted(c for c, _ in waits) == ["sheddable"] * 3
    assert q.shed() == 0
    cap.grow(2)
    await settle()
    assert cap.admitted == ["crit", "std"]


async def test_shedding_one_backend_leaves_sheddable_waiters_of_another() -> None:
    q, cap = make(0)
    on_a = spawn(q, cap, "a", priority="sheddable", backend="a")
    on_b = spawn(q, cap, "b", priority="sheddable", backend="b")
    await settle()
    assert q.shed("sheddable", "a") == 1
    await settle()
    with pytest.raises(Shed):
        on_a.result()
    assert not on_b.done()
    assert q.depth("sheddable") == 1
    cap.grow()
    await settle()
    assert cap.admitted == ["b"]


# ---------------------------------------------------------------------------- misc API


async def test_on_wait_reports_class_and_seconds_with_an_injected_clock() -> None:
    now = [10.0]
    waits: list[tuple[str, float]] = []
    q, cap = make(0, clock=lambda: now[0], on_wait=lambda c, s: waits.append((c, s)))
    task = spawn(q, cap, "w", priority="critical")
    await settle()
    now[0] = 12.5
    cap.grow()
    await settle()
    assert task.result().name == "w"
    assert waits == [("critical", 2.5)]


async def test_a_failing_on_wait_hook_is_logged_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom(cls: str, seconds: float) -> None:
        raise RuntimeError("metrics down")

    q, cap = make(0, on_wait=boom)
    task = spawn(q, cap, "w")
    await settle()
    with caplog.at_level(logging.ERROR, logger="kvgate.admission.wait_queue"):
        cap.grow()
    await settle()
    assert task.result().name == "w"
    assert "on_wait hook failed" in caplog.text
    assert len(q) == 0


async def test_repr_len_depth() -> None:
    q, cap = make(0, max_waiters=9)
    spawn(q, cap, "a", tenant="x", priority="critical")
    spawn(q, cap, "b", tenant="y", priority="sheddable")
    spawn(q, cap, "c", tenant="y", priority="sheddable")
    await settle()
    assert repr(q) == (
        "<PriorityWaitQueue waiters=3/9 critical=1 standard=0 sheddable=2 tenants=2>"
    )
    assert len(q) == q.depth() == 3
    assert q.tenant_depth("y") == 2
    assert q.tenant_depth("nobody") == 0
    q.max_waiters = 2  # lowering evicts nobody
    assert len(q) == 3
    for cls in PRIORITY_CLASSES:
        q.shed(cls)
    await settle()
    assert len(q) == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"priority": "urgent"}, ValueError, "unknown priority class 'urgent'"),
        ({"priority": None}, ValueError, "unknown priority class None"),
        ({"max_wait": -1}, ValueError, "max_wait must be finite seconds ≥ 0"),
        ({"max_wait": math.nan}, ValueError, "max_wait must be finite seconds ≥ 0"),
        ({"max_wait": math.inf}, ValueError, "max_wait must be finite seconds ≥ 0"),
        ({"max_wait": "5"}, TypeError, "max_wait must be seconds"),
        ({"max_wait": True}, TypeError, "max_wait must be seconds"),
        ({"tenant": 7}, TypeError, "tenant must be a str"),
        ({"try_admit": 3}, TypeError, "try_admit must be callable"),
    ],
)
async def test_wait_rejects_bad_arguments(kwargs, exc, message) -> None:
    q, cap = make(5)
    args = {"tenant": "a", "priority": "standard", "max_wait": 1.0, "try_admit": cap.admitter("x")}
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        await q.wait(**args)
    assert cap.calls == []  # bad input is refused before anything is tried or held
    assert len(q) == 0


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None])
def test_max_waiters_must_be_a_positive_int(bad) -> None:
    with pytest.raises(ValueError, match="max_waiters must be an int ≥ 1"):
        PriorityWaitQueue(max_waiters=bad)
    q: PriorityWaitQueue[Ticket] = PriorityWaitQueue(max_waiters=1)
    with pytest.raises(ValueError, match="max_waiters must be an int ≥ 1"):
        q.max_waiters = bad
    assert q.max_waiters == 1


def test_bad_hooks_and_class_names() -> None:
    with pytest.raises(TypeError, match="clock must be callable"):
        PriorityWaitQueue(max_waiters=1, clock=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_wait must be callable"):
        PriorityWaitQueue(max_waiters=1, on_wait="hist")  # type: ignore[arg-type]
    q: PriorityWaitQueue[Ticket] = PriorityWaitQueue(max_waiters=1)
    with pytest.raises(ValueError, match="unknown priority class 'bulk'"):
        q.depth("bulk")
    with pytest.raises(ValueError, match="unknown priority class 'bulk'"):
        q.shed("bulk")
    q.notify()  # nothing queued: a no-op


# ---------------------------------------------------------------------------- property test

TENANTS = ("a", "b", "c")

KINDS = ("arrive",) * 4 + ("release", "release", "release_then_cancel_admitted", "cancel")
KINDS += ("grow", "shed")


@st.composite
def op_strategy(draw: st.DrawFn) -> tuple:
    """One operation; arrivals are weighted up so that queues actually form."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "arrive":
        tenant = draw(st.sampled_from(TENANTS))
        priority = draw(st.sampled_from(PRIORITY_CLASSES))
        zero_wait = draw(st.integers(0, 5)) == 0  # max_wait = 0 now and then
        size = draw(st.sampled_from([1, 1, 2]))  # units of capacity it needs
        return (kind, tenant, priority, zero_wait, size)
    if kind == "cancel":
        return (kind, draw(st.integers(0, 50)))
    if kind == "shed":
        return (kind, draw(st.sampled_from(PRIORITY_CLASSES)))
    return (kind,)


async def _scenario(limit: int, max_waiters: int, ops: list[tuple]) -> None:
    q: PriorityWaitQueue[Ticket] = PriorityWaitQueue(max_waiters=max_waiters)
    cap = Capacity(limit, q)
    tasks: dict[int, asyncio.Task[Ticket]] = {}
    collected: set[int] = set()
    held: list[Ticket] = []
    admitted_seq: dict[tuple[str, str], list[int]] = {}
    last_admitted: list[int] = []

    def admitter(i: int, tenant: str, priority: str, size: int) -> Callable[[], Ticket | None]:
        def try_admit() -> Ticket | None:
            # strict order: a newcomer (tried in its own task, before queueing) only when
            # nobody of its class or higher waits; a queued waiter (tried by notify) only when
            # nobody of a higher class waits
            newcomer = asyncio.current_task() is tasks[i]
            ahead = PRIORITY_CLASSES[: PRIORITY_CLASSES.index(priority) + newcomer]
            assert all(q.depth(c) == 0 for c in ahead)
            if cap.in_use + size > cap.limit:
                return None
            cap.in_use += size
            admitted_seq.setdefault((tenant, priority), []).append(i)
            last_admitted.append(i)
            return Ticket(cap, str(i), size)

        return try_admit

    def collect() -> None:
        for i, task in tasks.items():
            if i in collected or not task.done():
                continue
            collected.add(i)
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is None:
                held.append(task.result())
            else:
                assert isinstance(exc, QueueRejected), exc

    def check() -> None:
        assert 0 <= cap.in_use <= cap.limit
        assert cap.in_use == sum(t.size for t in held)
        # nothing waits while there is capacity for the head: a spurious notify admits nobody
        admitted = len(last_admitted)
        q.notify()
        assert len(last_admitted) == admitted
        assert len(q) <= max_waiters
        assert len(q) == sum(1 for i, t in tasks.items() if not t.done())

    for op in ops:
        kind = op[0]
        if kind == "arrive":
            _, tenant, priority, zero, size = op
            i = len(tasks)
            tasks[i] = asyncio.create_task(
                q.wait(
                    tenant=tenant,
                    priority=priority,
                    max_wait=0 if zero else 600.0,
                    try_admit=admitter(i, tenant, priority, size),
                )
            )
        elif kind == "release" and held:
            held.pop(0).release()
        elif kind == "release_then_cancel_admitted" and held:
            before = len(last_admitted)
            held.pop().release()
            if len(last_admitted) > before:
                tasks[last_admitted[-1]].cancel()  # admitted but not yet resumed
        elif kind == "cancel":
            pending = [t for t in tasks.values() if not t.done()]
            if pending:
                pending[op[1] % len(pending)].cancel()
        elif kind == "grow":
            cap.grow()
        elif kind == "shed":
            q.shed(op[1])
        await settle()
        collect()
        check()

    for task in tasks.values():
        task.cancel()
    await settle()
    collect()
    while held:
        held.pop().release()
    await settle()
    assert len(q) == 0
    assert cap.in_use == 0
    assert all(t.done() for t in tasks.values())
    for order in admitted_seq.values():  # FIFO per tenant within a class
        assert order == sorted(order)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    limit=st.integers(0, 3),
    max_waiters=st.integers(1, 6),
    ops=st.lists(op_strategy(), min_size=10, max_size=60),
)
def test_random_interleavings_keep_the_invariants(limit, max_waiters, ops) -> None:
    asyncio.run(_scenario(limit, max_waiters, ops))
