"""Priority wait queue for requests that an admission limit refused.

What
    A request that a limit refused (no free slot, TPM bucket empty, ...) may wait up to its
    tenant's ``max_wait_ms`` for capacity instead of being answered at once (docs/admission.md, step
    4). :class:`PriorityWaitQueue` holds those waiters and hands capacity out again
    in priority order when the gateway says some was released.

Inputs
    ``wait(tenant=, priority=, max_wait=, try_admit=)`` from the request handler;
    ``notify()`` from the gateway after every ``Reservation.release`` and after a limit or the
    adaptive scale grew; ``shed(priority)`` when shedding starts (KV usage over the high
    watermark).

Rules
    * Order: ``critical`` before ``standard`` before ``sheddable``, strictly. Within a class,
      tenants that have waiters take turns (round-robin: a tenant that got a waiter admitted
      goes to the back of its class), and each tenant's own waiters are FIFO. One tenant's flood
      therefore cannot starve another tenant of the same class.
    * A waiter holds nothing while it waits. It only gets a reservation when ``notify()`` (or the
      first attempt in ``wait()``) calls its own ``try_admit()`` and that returns non-``None``.
    * ``notify()`` offers capacity to the head waiter, then the next, and stops at the first
      whose ``try_admit()`` still refuses. Nobody behind a refused head is tried (no
      head-of-line bypass), even if a smaller request further back would fit: a huge
      ``sheddable`` request at the head of its class blocks the small ones behind it, and a
      ``critical`` head blocks everything behind it. This keeps the order strict and simple;
      the head is never starved by a stream of small requests overtaking it.
    * Event-driven: nothing polls. Each waiter has a single ``loop.call_later`` timer for its
      own deadline; wake-ups come only from ``notify()``, or from a head waiter leaving (timeout,
      cancel, shed), which re-runs ``notify()`` because the new head may fit.
    * A waiting task that is cancelled (client went away) leaves the queue at once. If it was
      cancelled in the instant between being admitted and resuming, its reservation is
      released (see ``release`` in :meth:`PriorityWaitQueue.wait`), so nothing leaks.

Config
    ``max_waiters`` (int ≥ 1, no default): bound on queued waiters over all classes; over it
    :class:`QueueFull` (the gateway answers 503). When the queue is full, a waiter of a higher
    class displaces the newest waiter of the lowest lower class (that one gets
    :class:`QueueFull`), so a ``sheddable`` flood cannot lock ``critical`` out of the queue.
    ``clock`` (callable returning seconds, default the running loop's ``loop.time``): only used
    to measure how long a waiter waited (``on_wait``); deadlines are loop timers.
    ``on_wait`` (callable ``(priority class, seconds waited)``, default none): called once for
    every waiter that was queued, whatever way it left (admitted, timed out, shed, displaced,
    cancelled); feeds the ``kvgate_queue_wait_seconds`` histogram.

Trade-offs
    Strict priority can starve lower classes for as long as higher ones keep the backend busy;
    that is intended (``sheddable`` traffic soaks up what is left). There is no head-of-line
    bypass, so a large head request can hold up small ones of its own or lower classes until
    capacity for it is free or its ``max_wait`` passes. The queue is per event loop (per
    worker process) and not thread-safe: call it from the loop that runs the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

__all__ = [
    "PRIORITY_CLASSES",
    "PriorityWaitQueue",
    "QueueFull",
    "QueueRejected",
    "Shed",
    "WaitTimeout",
]

T = TypeVar("T")

_log = logging.getLogger(__name__)

#: Priority classes, highest first (the field's terms: ``critical`` traffic such as online chat,
#: ``standard``, and ``sheddable`` offline work, the first shed under KV pressure).
PRIORITY_CLASSES: Final[tuple[str, ...]] = ("critical", "standard", "sheddable")
_RANK: Final[dict[str, int]] = {name: rank for rank, name in enumerate(PRIORITY_CLASSES)}


class QueueRejected(Exception):
    """A request could not be admitted through the wait queue.

    Attributes:
        tenant: the tenant of the refused request (never logged by this module).
        priority: its priority class (``critical`` / ``standard`` / ``sheddable``).
    """

    def __init__(self, message: str, *, tenant: str, priority: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.priority = priority


class QueueFull(QueueRejected):
    """The queue already holds ``max_waiters`` waiters, or this waiter was displaced by a
    higher class when it was full. The gateway answers 503.

    Attributes:
        max_waiters: the bound in force (waiters).
    """

    def __init__(self, message: str, *, tenant: str, priority: str, max_waiters: int) -> None:
        super().__init__(message, tenant=tenant, priority=priority)
        self.max_waiters = max_waiters


class WaitTimeout(QueueRejected):
    """No capacity came within ``max_wait`` seconds (or ``max_wait`` was 0 and the request
    could not be admitted at once). The gateway answers with the original refusal.

    Attributes:
        max_wait: the wait allowed (seconds).
    """

    def __init__(self, message: str, *, tenant: str, priority: str, max_wait: float) -> None:
        super().__init__(message, tenant=tenant, priority=priority)
        self.max_wait = max_wait


class Shed(QueueRejected):
    """The waiter's priority class was shed while it waited (``PriorityWaitQueue.shed``).
    The gateway answers 503."""


class _Waiter:
    """One queued request: its identity, its admission callback and the future it awaits."""

    __slots__ = (
        "backend",
        "enqueued_at",
        "future",
        "max_wait",
        "priority",
        "queued",
        "rank",
        "seq",
        "tenant",
        "timer",
        "try_admit",
    )

    def __init__(
        self,
        *,
        seq: int,
        tenant: str,
        priority: str,
        rank: int,
        max_wait: float,
        try_admit: Callable[[], Any],
        future: asyncio.Future[Any],
        enqueued_at: float,
        backend: str | None = None,
    ) -> None:
        self.backend = backend
        self.seq = seq
        self.tenant = tenant
        self.priority = priority
        self.rank = rank
        self.max_wait = max_wait
        self.try_admit = try_admit
        self.future = future
        self.enqueued_at = enqueued_at
        self.timer: asyncio.TimerHandle | None = None
        self.queued = True


class PriorityWaitQueue(Generic[T]):
    """Asyncio wait queue for refused requests: strict priority, per-tenant round-robin.

    See the module docstring for the rules. All durations are seconds.

    Args:
        max_waiters: bound on queued waiters over all classes (int ≥ 1).
        clock: callable returning monotonic seconds; default the running loop's ``time``.
            Used only to measure time waited for ``on_wait``.
        on_wait: optional hook ``(priority class, seconds waited)`` called once per queued
            waiter when it leaves the queue, for any reason. Exceptions from it are logged,
            never propagated.

    Raises:
        ValueError: ``max_waiters`` is not an int ≥ 1.
        TypeError: ``clock`` or ``on_wait`` is not callable.
    """

    __slots__ = (
        "_classes",
        "_clock",
        "_count",
        "_draining",
        "_max_waiters",
        "_on_wait",
        "_redrain",
        "_seq",
        "_wakeup",
        "waiting",
    )

    def __init__(
        self,
        *,
        max_waiters: int,
        clock: Callable[[], float] | None = None,
        on_wait: Callable[[str, float], None] | None = None,
    ) -> None:
        self._max_waiters = _check_max_waiters(max_waiters)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable returning seconds, got {clock!r}")
        if on_wait is not None and not callable(on_wait):
            raise TypeError(f"on_wait must be callable (class, seconds), got {on_wait!r}")
        self._clock = clock
        self._on_wait = on_wait
        # One OrderedDict per class, highest first: tenant -> (seq -> waiter). The order of the
        # outer dict is the round-robin order of tenants; the inner one is FIFO per tenant.
        self._classes: tuple[OrderedDict[str, OrderedDict[int, _Waiter]], ...] = tuple(
            OrderedDict() for _ in PRIORITY_CLASSES
        )
        self._count = [0] * len(PRIORITY_CLASSES)
        #: Requests waiting, all classes (a plain attribute: the request path reads it on every
        #: admission and release).
        self.waiting = 0
        self._seq = 0
        self._draining = False
        self._redrain = False
        #: the pending timed :meth:`notify` (:meth:`notify_after`)
        self._wakeup: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ config / inspection

    @property
    def max_waiters(self) -> int:
        """Bound on queued waiters (int ≥ 1). Settable (config reload); lowering it evicts
        nobody, it only refuses new waiters until the queue drains below it."""
        return self._max_waiters

    @max_waiters.setter
    def max_waiters(self, value: int) -> None:
        self._max_waiters = _check_max_waiters(value)

    def depth(self, priority: str | None = None) -> int:
        """Number of queued waiters, of one class or (``None``) of all classes.

        Raises:
            ValueError: unknown priority class.
        """
        if priority is None:
            return sum(self._count)
        return self._count[_rank(priority)]

    def tenant_depth(self, tenant: str) -> int:
        """Number of queued waiters of one tenant, over all classes (for ``/admin/state``)."""
        return sum(len(cls.get(tenant, ())) for cls in self._classes)

    def backend_depths(self) -> dict[str, dict[str, int]]:
        """Queued waiters per backend and priority class (``{backend: {class: n}}``; waiters
        queued without a backend under ``""``). Walks every waiter: for the dashboard's
        once-a-second poll, not the request path."""
        out: dict[str, dict[str, int]] = {}
        for name, cls in zip(PRIORITY_CLASSES, self._classes, strict=True):
            for fifo in cls.values():
                for waiter in fifo.values():
                    per = out.setdefault(waiter.backend or "", dict.fromkeys(PRIORITY_CLASSES, 0))
                    per[name] += 1
        return out

    def __len__(self) -> int:
        return self.waiting

    def __repr__(self) -> str:
        per_class = " ".join(
            f"{name}={count}" for name, count in zip(PRIORITY_CLASSES, self._count, strict=True)
        )
        tenants = len({t for cls in self._classes for t in cls})
        return (
            f"<PriorityWaitQueue waiters={len(self)}/{self._max_waiters} {per_class} "
            f"tenants={tenants}>"
        )

    # ------------------------------------------------------------------ the three verbs

    async def wait(
        self,
        *,
        tenant: str,
        priority: str,
        max_wait: float,
        try_admit: Callable[[], T | None],
        release: Callable[[T], object] | None = None,
        backend: str | None = None,
    ) -> T:
        """Admit now if possible, else wait in the queue for at most ``max_wait`` seconds.

        ``try_admit()`` is called first, unless a waiter of the same or a higher class is
        already queued (then this request queues behind it without trying, to keep the order).
        A non-``None`` result is the reservation and is returned. Otherwise the request waits;
        ``notify()`` calls its ``try_admit()`` again when it reaches the head. An exception
        raised by ``try_admit()`` propagates out of ``wait()`` and the waiter leaves the queue.

        Args:
            tenant: tenant name (used for round-robin fairness within a class).
            priority: ``critical``, ``standard`` or ``sheddable``.
            max_wait: longest wait (seconds, finite, ≥ 0). 0 means do not wait.
            try_admit: non-blocking admission attempt returning a reservation or ``None``.
                It must not block or await.
            release: how to give a reservation back if the task is cancelled between being
                admitted by ``notify()`` and resuming (default: ``reservation.release()``).
                After releasing, the queue runs ``notify()`` itself.
            backend: the backend the request waits for (so :meth:`shed` can answer only the
                waiters of a backend under pressure); ``None``: any.

        Returns:
            The reservation returned by ``try_admit()``.

        Raises:
            WaitTimeout: ``max_wait`` passed (or was 0) without admission.
            QueueFull: the queue holds ``max_waiters`` already, or a higher class displaced
                this waiter.
            Shed: this waiter's class was shed while it waited.
            asyncio.CancelledError: the task was cancelled; the waiter has left the queue and
                holds nothing.
            ValueError: unknown priority class, or ``max_wait`` negative, NaN or infinite.
            TypeError: ``tenant`` not a str, or ``try_admit`` not callable.
        """
        rank = _rank(priority)
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        if not callable(try_admit):
            raise TypeError(f"try_admit must be callable, got {try_admit!r}")
        if isinstance(max_wait, bool) or not isinstance(max_wait, int | float):
            raise TypeError(f"max_wait must be seconds (int or float), got {max_wait!r}")
        if not math.isfinite(max_wait) or max_wait < 0:
            raise ValueError(f"max_wait must be finite seconds ≥ 0, got {max_wait!r}")

        if not any(self._count[: rank + 1]):
            reservation = try_admit()
            if reservation is not None:
                return reservation
        if max_wait == 0:
            raise WaitTimeout(
                f"refused and not allowed to wait (max_wait=0) in class {priority}",
                tenant=tenant,
                priority=priority,
                max_wait=0.0,
            )
        if len(self) >= self._max_waiters and not self._displace_below(rank):
            raise QueueFull(
                f"wait queue full ({self._max_waiters} waiters); {priority} request refused",
                tenant=tenant,
                priority=priority,
                max_waiters=self._max_waiters,
            )

        loop = asyncio.get_running_loop()
        self._seq += 1
        waiter = _Waiter(
            seq=self._seq,
            tenant=tenant,
            priority=priority,
            rank=rank,
            max_wait=float(max_wait),
            try_admit=try_admit,
            future=loop.create_future(),
            enqueued_at=self._now(loop),
            backend=backend,
        )
        self._classes[rank].setdefault(tenant, OrderedDict())[waiter.seq] = waiter
        self._count[rank] += 1
        self.waiting += 1
        waiter.timer = loop.call_later(max_wait, self._expire, waiter)

        fut = waiter.future
        try:
            return await fut  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                if fut.exception() is None:
                    # Admitted by notify() but cancelled before resuming: give it back.
                    self._give_back(fut.result(), release)
            elif waiter.queued:
                was_head = self._head() is waiter
                self._leave(waiter)
                if was_head:
                    self.notify()
            raise

    def notify(self) -> None:
        """Capacity was released or a limit grew: admit head waiters while they fit.

        Calls the head waiter's ``try_admit()``; on success hands it the reservation and goes
        on with the next head; stops at the first refusal (strict order, no bypass). Safe to
        call at any time, also from inside a ``try_admit()`` or ``release`` callback (the call
        is then folded into the running one). Never blocks; never raises.
        """
        if self._draining:
            self._redrain = True
            return
        self._draining = True
        try:
            self._redrain = True
            while self._redrain:
                self._redrain = False
                self._drain()
        finally:
            self._draining = False

    def notify_after(self, delay: float) -> None:
        """:meth:`notify` in ``delay`` seconds (on the running loop): a waiter refused by a token
        bucket fits again when the bucket has refilled, which no release announces. Only the
        earliest pending wake-up is kept (the waiter it wakes schedules the next one if it
        still does not fit)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        pending = self._wakeup
        if pending is not None:
            if pending.when() <= when:
                return
            pending.cancel()
        self._wakeup = loop.call_at(when, self._wakeup_due)

    def _wakeup_due(self) -> None:
        self._wakeup = None
        self.notify()

    def shed(self, priority: str = "sheddable", backend: str | None = None) -> int:
        """Answer every queued waiter of one class with :class:`Shed` at once — only those
        waiting for ``backend`` when it is given (and those queued without a backend).

        Waiters of other classes (and backends) stay. New arrivals are not refused by this
        call: the gateway decides whether to send a request of a shed class here at all.

        Returns:
            How many waiters were shed.

        Raises:
            ValueError: unknown priority class.
        """
        rank = _rank(priority)
        victims = [
            w
            for q in self._classes[rank].values()
            for w in q.values()
            if backend is None or w.backend in (None, backend)
        ]
        for waiter in victims:
            self._leave(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(
                    Shed(
                        f"class {priority} is being shed (backend under pressure)",
                        tenant=waiter.tenant,
                        priority=priority,
                    )
                )
        if victims:
            self.notify()  # a lower class may now be at the head and fit
        return len(victims)

    # ------------------------------------------------------------------ internals

    def _now(self, loop: asyncio.AbstractEventLoop | None = None) -> float:
        if self._clock is not None:
            return self._clock()
        return (loop or asyncio.get_running_loop()).time()

    def _head(self) -> _Waiter | None:
        for cls in self._classes:
            if cls:
                queue = next(iter(cls.values()))
                return next(iter(queue.values()))
        return None

    def _leave(self, waiter: _Waiter, *, admitted: bool = False) -> None:
        """Take a queued waiter out (idempotent), stop its timer, report its wait."""
        if not waiter.queued:
            return
        waiter.queued = False
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        cls = self._classes[waiter.rank]
        queue = cls[waiter.tenant]
        del queue[waiter.seq]
        if not queue:
            del cls[waiter.tenant]
        elif admitted:
            cls.move_to_end(waiter.tenant)  # round-robin: this tenant had its turn
        self._count[waiter.rank] -= 1
        self.waiting -= 1
        if self._on_wait is not None:
            try:
                waited = self._now(waiter.future.get_loop()) - waiter.enqueued_at
                self._on_wait(waiter.priority, max(0.0, waited))
            except Exception:
                _log.exception("on_wait hook failed; queue state is unaffected")

    def _drain(self) -> None:
        while (waiter := self._head()) is not None:
            if waiter.future.done():
                # Its task was cancelled and has not run its cleanup yet.
                self._leave(waiter)
                continue
            try:
                reservation = waiter.try_admit()
            except Exception as exc:
                self._leave(waiter)
                waiter.future.set_exception(exc)
                continue
            if reservation is None:
                return
            self._leave(waiter, admitted=True)
            waiter.future.set_result(reservation)

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        if waiter.future.done() or not waiter.queued:
            return
        was_head = self._head() is waiter
        self._leave(waiter)
        waiter.future.set_exception(
            WaitTimeout(
                f"no capacity within max_wait={waiter.max_wait:g}s in class {waiter.priority}",
                tenant=waiter.tenant,
                priority=waiter.priority,
                max_wait=waiter.max_wait,
            )
        )
        if was_head:
            self.notify()

    def _displace_below(self, rank: int) -> bool:
        """Queue full: evict the newest waiter of the lowest class below ``rank``, taken from
        the tenant with the most waiters there. Returns False when there is none."""
        for low in range(len(PRIORITY_CLASSES) - 1, rank, -1):
            cls = self._classes[low]
            if not cls:
                continue
            queue = max(cls.values(), key=len)
            victim = next(reversed(queue.values()))
            self._leave(victim)
            if not victim.future.done():
                victim.future.set_exception(
                    QueueFull(
                        f"displaced from the full wait queue ({self._max_waiters} waiters) "
                        f"by a higher-priority request",
                        tenant=victim.tenant,
                        priority=victim.priority,
                        max_waiters=self._max_waiters,
                    )
                )
            return True
        return False

    def _give_back(self, reservation: T, release: Callable[[T], object] | None) -> None:
        if release is not None:
            release(reservation)
        else:
            release_method = getattr(reservation, "release", None)
            if not callable(release_method):
                _log.error(
                    "a waiter was cancelled after admission and its reservation %r has no "
                    "release(); pass release= to PriorityWaitQueue.wait",
                    type(reservation).__name__,
                )
                return
            release_method()
        self.notify()


def _rank(priority: str) -> int:
    try:
        return _RANK[priority]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown priority class {priority!r}; expected one of {', '.join(PRIORITY_CLASSES)}"
        ) from None


def _check_max_waiters(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_waiters must be an int ≥ 1, got {value!r}")
    return value
