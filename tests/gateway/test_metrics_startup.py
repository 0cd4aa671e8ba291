"""``/metrics`` of a gateway that has just started: the shedding, staleness and scrape-error
series exist for every backend at 0 (before, a healthy gateway exported none of them); and
scrapes that come together share one text."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import aiohttp

from kvgate.config import Config

from .conftest import RunningGateway
from .helpers import STARTUP_SERIES, free_port, get_text, samples


def assert_startup_series(text: str, backends: list[str]) -> None:
    for name, extra in STARTUP_SERIES:
        found = samples(text, name)
        assert sorted(found) == sorted(backends), (name, found)
        for backend in backends:
            assert found[backend] == [({"backend": backend, **extra}, 0.0)], (name, found)


def two_backends() -> Config:
    # nothing listens on these ports: no request reaches them and nothing polls them (poll=False)
    def backend(name: str, model: str) -> dict[str, Any]:
        return {
            "name": name,
            "url": f"http://127.0.0.1:{free_port()}",
            "models": [{"name": model, "context_window": 1024}],
            "max_concurrency": 4,
        }

    return Config.model_validate({"backends": [backend("b0", "m0"), backend("b1", "m1")]})


async def test_fresh_gateway_exports_the_series_at_zero_for_every_backend(
    gateway_for: Callable[..., contextlib.AbstractAsyncContextManager[RunningGateway]],
) -> None:
    async with gateway_for(two_backends()) as gw:
        text = await get_text(gw.url + "/metrics")
    assert_startup_series(text, ["b0", "b1"])


async def test_scrapes_that_come_together_share_one_text(
    gateway_for: Callable[..., contextlib.AbstractAsyncContextManager[RunningGateway]],
) -> None:
    """Scrapes that arrive while a text is being written get that text (a flood of scrapes of
    a large gateway costs one); a scrape after it gets a new one; a client that goes away
    does not cancel the text the others wait for."""
    async with gateway_for(two_backends()) as gw:
        gateway = gw.gateway
        snapshot = gateway.metrics.snapshot
        metrics_text = gateway.metrics_text
        texts = arrived = 0
        hold = threading.Event()
        changed = asyncio.Event()

        def counted() -> Callable[[], bytes]:
            nonlocal texts
            texts += 1
            write = snapshot()

            def slow() -> bytes:
                hold.wait(10)  # (on the worker thread: the scrapes pile up meanwhile)
                return write()

            return slow

        def arriving() -> Any:
            nonlocal arrived
            arrived += 1
            changed.set()
            return metrics_text()

        gateway.metrics.snapshot = counted  # type: ignore[method-assign]
        gateway.metrics_text = arriving  # type: ignore[method-assign]
        async with aiohttp.ClientSession() as s:

            async def scrape() -> str:
                async with s.get(gw.url + "/metrics") as r:
                    assert r.status == 200
                    return await r.text()

            scrapes = [asyncio.create_task(scrape()) for _ in range(10)]
            async with asyncio.timeout(10):
                while arrived < 10:
                    changed.clear()
                    await changed.wait()
            scrapes[1].cancel()  # this client goes away while the text is written
            hold.set()
            bodies = await asyncio.gather(scrapes[0], *scrapes[2:])
            assert texts == 1
            assert len(set(bodies)) == 1
            assert_startup_series(bodies[0], ["b0", "b1"])
            await scrape()
            assert texts == 2
