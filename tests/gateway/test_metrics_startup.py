"""``/metrics`` of a gateway that has just started: the shedding, staleness and scrape-error
series exist for every backend at 0 (before, a healthy gateway exported none of them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

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
