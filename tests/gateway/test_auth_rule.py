"""Which tenant a request runs as (docs/admission.md, step 2): only a request
with no key is the anonymous tenant's; a key that matches no tenant is always 401."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvgate.app import Gateway
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import sha
from .fake_upstream import run_upstream
from .helpers import chat

BASIC = "Basic dXNlcjpzay1hbGljZQ=="  # user:sk-alice, base64: Basic credentials are not read


def config(url: str, **top: Any) -> Config:
    return Config.model_validate(
        {
            "backends": [
                {
                    "name": "b0",
                    "url": url,
                    "models": [{"name": "replay", "context_window": 1024}],
                    "max_concurrency": 8,
                    "adaptive": {"enabled": False},
                }
            ],
            **top,
        }
    )


def ok_count(gateway: Gateway, tenant: str) -> float:
    gateway.metrics.flush()
    return float(gateway.metrics.requests.labels("b0", tenant, "ok")._value.get())


async def tenant_of(
    s: aiohttp.ClientSession, url: str, gateway: Gateway, headers: dict[str, str]
) -> str:
    """The tenant the request ran as, or ``"401 <code>"``."""
    before = {t: ok_count(gateway, t) for t in ("alice", "anon", "anonymous")}
    async with s.post(url + "/v1/chat/completions", json=chat("replay"), headers=headers) as r:
        body = await r.json()
        if r.status != 200:
            return f"{r.status} {body['error']['code']}"
    changed = [t for t, n in before.items() if ok_count(gateway, t) == n + 1]
    assert len(changed) == 1, changed
    return changed[0]


def alice_and_anon(url: str) -> Config:
    """Tenant ``alice`` (key ``sk-alice``) and the anonymous tenant ``anon``."""
    return config(
        url,
        tenants=[{"name": "alice", "api_key_sha256": [sha("sk-alice")]}, {"name": "anon"}],
        anonymous_tenant="anon",
    )


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Authorization": "Bearer sk-alice"}, "alice"),
        ({"Authorization": "bearer sk-alice"}, "alice"),
        ({"api-key": "sk-alice"}, "alice"),
        ({"Authorization": BASIC, "api-key": "sk-alice"}, "alice"),
        ({}, "anon"),
        ({"Authorization": "Bearer "}, "anon"),
        ({"api-key": ""}, "anon"),
        ({"Authorization": BASIC}, "anon"),
        ({"Authorization": "Bearer nope"}, "401 invalid_api_key"),
        ({"api-key": "nope"}, "401 invalid_api_key"),
        ({"Authorization": BASIC, "api-key": "nope"}, "401 invalid_api_key"),
    ],
)
async def test_only_a_request_without_a_key_is_anonymous(
    headers: dict[str, str], expected: str
) -> None:
    async with run_upstream() as up:
        gateway = build_gateway(alice_and_anon(up.url), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            assert await tenant_of(s, url, gateway, headers) == expected


async def test_without_an_anonymous_tenant_no_key_is_401() -> None:
    async with run_upstream() as up:
        cfg = config(up.url, tenants=[{"name": "alice", "api_key_sha256": [sha("sk-alice")]}])
        gateway = build_gateway(cfg, poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": BASIC}, {"Authorization": "Bearer nope"}):
                assert await tenant_of(s, url, gateway, headers) == "401 invalid_api_key"


async def test_when_no_tenant_has_a_key_keys_are_not_read() -> None:
    async with run_upstream() as up:
        gateway = build_gateway(config(up.url), poll=False)  # no tenants: implicit "anonymous"
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"api-key": "nope"}):
                assert await tenant_of(s, url, gateway, headers) == "anonymous"


async def test_an_empty_bearer_value_defers_to_api_key() -> None:
    """HTTP strips trailing whitespace from a header value: ``Bearer `` arrives as ``Bearer``, a
    scheme with no credentials, so the ``api-key`` header is read."""
    async with run_upstream() as up:
        gateway = build_gateway(alice_and_anon(up.url), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            headers = {"Authorization": "Bearer ", "api-key": "sk-alice"}
            assert await tenant_of(s, url, gateway, headers) == "alice"
