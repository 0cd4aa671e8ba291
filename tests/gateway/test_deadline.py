"""The relay's timeouts: deadlines swept by one watchdog instead of a timer per wait, with
``asyncio.timeout``'s semantics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.proxy.deadline import Watchdog

RES = 0.02


@pytest.fixture
async def dog() -> AsyncIterator[Watchdog]:
    w = Watchdog(resolution=RES)
    w.start()
    yield w
    await w.stop()


async def test_a_wait_past_its_deadline_raises_timeout_error(dog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    d = dog.deadline()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        with d.at(loop.time() + 0.1):
            await asyncio.sleep(5)
    took = time.monotonic() - started
    assert 0.1 <= took < 0.1 + RES + 0.5  # fires at most one sweep late (plus a busy machine)
    assert not dog._armed
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    # the same deadline object serves the next wait of the request
    with d.at(loop.time() + 5):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # and no stray cancellation is left behind


async def test_a_wait_that_finishes_in_time_is_untouched(dog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    d = dog.deadline()
    for _ in range(3):
        with d.at(loop.time() + 0.5):
            await asyncio.sleep(0.01)
    assert not dog._armed
    await asyncio.sleep(0.6)  # past every deadline: nothing fires once outside the block


async def test_time_outside_the_block_does_not_count(dog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    d = dog.deadline()
    when = loop.time() + 0.05
    with d.at(when):
        await asyncio.sleep(0)
    await asyncio.sleep(0.15)  # e.g. writing to a slow client: not an upstream wait
    with pytest.raises(TimeoutError):  # re-armed with the old, passed deadline: fires
        with d.at(when):
            await asyncio.sleep(5)


async def test_a_cancellation_from_elsewhere_passes_through(dog: Watchdog) -> None:
    loop = asyncio.get_running_loop()

    async def wait() -> None:
        with dog.deadline().at(loop.time() + 5):
            await asyncio.sleep(5)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.05)
    task.cancel()  # a client disconnect cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not dog._armed


async def test_no_deadline_and_a_stopped_watchdog_never_fire() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog(resolution=RES)
    dog.start()
    with dog.deadline().at(None):
        await asyncio.sleep(0.05)
    await dog.stop()
    with dog.deadline().at(loop.time()):  # already due, but nobody sweeps
        await asyncio.sleep(0.1)


async def test_sweep_fires_only_what_is_due() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog(resolution=10)  # never sweeps by itself in this test

    async def wait(when: float) -> str:
        try:
            with dog.deadline().at(when):  # made in the task that waits
                await asyncio.sleep(5)
        except TimeoutError:
            return "timeout"
        return "done"

    now = loop.time()
    t1 = asyncio.create_task(wait(now + 1))
    t2 = asyncio.create_task(wait(now + 3))
    await asyncio.sleep(0)
    assert dog.sweep(now + 2) == 1
    assert await t1 == "timeout"
    assert not t2.done()
    assert dog.sweep(now + 4) == 1
    assert await t2 == "timeout"


def test_bad_resolution_is_refused() -> None:
    with pytest.raises(ValueError, match="resolution"):
        Watchdog(resolution=0)
    with pytest.raises(ValueError, match="resolution"):
        Watchdog(resolution=float("nan"))


def test_a_deadline_is_made_inside_a_task() -> None:
    with pytest.raises(RuntimeError, match="inside a task"):
        Watchdog().deadline()
