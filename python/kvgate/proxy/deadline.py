"""Upstream timeouts without a timer per wait: one sweep per loop checks every armed deadline.

``asyncio.timeout`` schedules an event-loop timer on entry and cancels it on exit; under uvloop
each costs a libuv timer start and stop plus a handle object — on this project's load benchmark
about 10 µs of CPU per admitted request for the first-byte timer alone, and as much again per
streamed chunk the relay waits for. A proxy's timeouts are seconds long and need no microsecond
precision, so :class:`Watchdog` keeps the armed deadlines in a set and checks them every
``resolution`` seconds (one timer for the whole gateway); :class:`Deadline` has
``asyncio.timeout``'s semantics (the waiting task is cancelled and the cancellation surfaces as
``TimeoutError`` at the ``with`` block; a cancellation from elsewhere, such as a client
disconnect, passes through untouched) and is a plain ``with`` block, reusable for every wait of
one request. A deadline fires between 0 and ``resolution`` seconds late.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

__all__ = ["Deadline", "Watchdog"]


class Watchdog:
    """The armed deadlines of one event loop, swept every ``resolution`` seconds.

    Args:
        resolution: seconds between sweeps (> 0); the most a deadline fires late.

    Use :meth:`start` / :meth:`stop` inside the running loop (``kvgate.server`` does).
    """

    __slots__ = ("_armed", "_task", "resolution")

    def __init__(self, resolution: float = 0.05) -> None:
        if not resolution > 0:
            raise ValueError(f"resolution must be > 0 seconds, got {resolution!r}")
        self.resolution = resolution
        self._armed: set[Deadline] = set()
        self._task: asyncio.Task[None] | None = None

    def deadline(self) -> Deadline:
        """A new, unarmed deadline for the waits of the current task (one request).

        Raises:
            RuntimeError: called outside a task.
        """
        return Deadline(self)

    def sweep(self, now: float) -> int:
        """Fire every armed deadline due at loop time ``now``; returns how many fired."""
        due = [d for d in self._armed if d._when <= now]
        for d in due:
            self._armed.discard(d)
            d._fire()
        return len(due)

    def start(self) -> None:
        """Start sweeping (in the running loop); idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop sweeping; armed deadlines then never fire."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.resolution)
            if self._armed:
                self.sweep(loop.time())


class Deadline:
    """``with deadline.at(when): await ...`` — the wait is cancelled once the loop time passes
    ``when`` (``None``: no deadline) and ``TimeoutError`` is raised from the ``with`` block.

    One object per request, made in the task that waits; armed only while inside a ``with``
    block (so time spent elsewhere, such as writing to a slow client, never counts). Not
    re-entrant.

    Raises:
        RuntimeError: made outside a task.
    """

    __slots__ = ("_armed", "_cancelling", "_expired", "_task", "_when")

    def __init__(self, dog: Watchdog) -> None:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop
            task = None
        if task is None:
            raise RuntimeError("Deadline must be made inside a task")
        self._armed = dog._armed
        self._task = task
        self._when = 0.0
        self._cancelling = 0
        self._expired = False

    def at(self, when: float | None) -> Deadline | contextlib.nullcontext[None]:
        """Arm for loop time ``when`` (seconds, ``loop.time()`` clock) for one ``with`` block."""
        if when is None:
            return contextlib.nullcontext()
        self._when = when
        return self

    def __enter__(self) -> Deadline:
        self._cancelling = self._task.cancelling()
        self._expired = False
        self._armed.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._armed.discard(self)
        if self._expired:
            self._expired = False
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _fire(self) -> None:
        task = self._task
        if not task.done():
            self._expired = True
            task.cancel()
