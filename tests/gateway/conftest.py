"""Fixtures for the gateway tests: a gateway on 127.0.0.1 in front of an upstream."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvgate.app import Gateway
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "batch": "sk-batch"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config_for(
    upstream: str,
    models: list[str],
    *,
    context_window: int = 1024,
    max_concurrency: int = 8,
    tokens_per_minute: int | None = 1_000_000,
    inflight_token_limit: int | None = None,
    tenants: list[dict[str, Any]] | None = None,
    timeouts: dict[str, float] | None = None,
    max_body_bytes: int = 1_000_000,
    adaptive: bool = False,
    stream_upstream: bool = True,
) -> Config:
    """A one-backend configuration; without ``tenants`` an anonymous standard tenant
    (``stream_upstream=False``: non-streamed requests go to the engine as they came)."""
    backend: dict[str, Any] = {
        "name": "b0",
        "url": upstream,
        "models": [{"name": m, "context_window": context_window} for m in models],
        "max_concurrency": max_concurrency,
        "tokens_per_minute": tokens_per_minute,
        "inflight_token_limit": inflight_token_limit,
        "adaptive": {"enabled": adaptive, "poll_interval": 0.05, "stale_after": 0.5},
        "stream_upstream": stream_upstream,
    }
    data: dict[str, Any] = {"backends": [backend], "max_body_bytes": max_body_bytes}
    if tenants is not None:
        data["tenants"] = tenants
    if timeouts:
        data["timeouts"] = timeouts
    return Config.model_validate(data)


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway

    def backend_state(self) -> dict[str, Any]:
        return dict(self.gateway.controller.backend_state(0))

    def tenant_state(self, name: str) -> dict[str, Any]:
        ctl = self.gateway.controller
        return dict(ctl.tenant_state(ctl.tenant_id(name)))


@pytest.fixture
def gateway_for() -> Callable[..., contextlib.AbstractAsyncContextManager[RunningGateway]]:
    """``async with gateway_for(config, poll=False) as gw:`` serves a gateway for ``config``."""

    @contextlib.asynccontextmanager
    async def start(config: Config, *, poll: bool = False) -> AsyncIterator[RunningGateway]:
        gateway = build_gateway(config, poll=poll)
        async with run_gateway(gateway) as url:
            yield RunningGateway(url, gateway)

    return start
