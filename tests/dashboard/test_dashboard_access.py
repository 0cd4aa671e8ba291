"""``/dashboard`` and ``/dashboard/data`` over HTTP, without a browser: the admin key taken once
from the query string and kept in an HttpOnly, SameSite=Strict cookie scoped to the dashboard;
the page's files shipped in the package; the data equal to ``/admin/state`` and ``/metrics``
while requests run, wait and are refused (an in-process gateway in front of ``kvgate sim``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from tests.gateway.conftest import sha
from tests.gateway.helpers import bearer, chat, metric, until
from tests.gateway.tls_certs import self_signed
from tests.store.replicas import run_replicas

from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig, run_sim
from kvgate.tls import server_context

ADMIN_KEY = "sk-admin-dash/+ key=1"  # characters a cookie value cannot hold as they are
KEYS = {"alice": "sk-alice", "batch": "sk-batch"}


def _config(url: str, model: str, *, admin: bool = True, slots: int = 1) -> Config:
    data: dict[str, Any] = {
        "backends": [
            {
                "name": "b0",
                "url": url,
                "engine": "vllm",
                "models": [{"name": model, "context_window": 1024}],
                "max_concurrency": slots,
            }
        ],
        "tenants": [
            {
                "name": "alice",
                "api_key_sha256": [sha(KEYS["alice"])],
                "priority": "critical",
                "max_wait_ms": 30000,
            },
            {
                "name": "batch",
                "api_key_sha256": [sha(KEYS["batch"])],
                "priority": "sheddable",
                "max_wait_ms": 0,
            },
        ],
    }
    if admin:
        data["admin_key_sha256"] = sha(ADMIN_KEY)
    return Config.model_validate(data)


@contextlib.asynccontextmanager
async def _gateway(
    admin: bool = True, poll: bool = False, **sim: Any
) -> AsyncIterator[tuple[str, Any, str]]:
    """(gateway URL, gateway, model) in front of an in-process simulator (``poll``: the
    engine's metrics are read, which gives the backend its prefill budget)."""
    cfg = SimConfig.from_profile("tiny", seed=1, **({"speed": 50} | sim))
    async with run_sim(cfg) as engine:
        gateway = build_gateway(_config(engine.url, cfg.model, admin=admin), poll=poll)
        async with run_gateway(gateway) as url:
            yield url, gateway, cfg.model


def _error_code(raw: bytes) -> str:
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return str(err["code"])


def _set_cookie(resp: aiohttp.ClientResponse) -> SimpleCookie:
    jar: SimpleCookie = SimpleCookie()
    for header in resp.headers.getall("Set-Cookie", []):
        jar.load(header)
    return jar


async def test_the_key_opens_the_dashboard_once_and_a_cookie_keeps_it_open() -> None:
    async with _gateway() as (url, _gw, _model), aiohttp.ClientSession() as s:
        # without the key: 401 in OpenAI's shape, for the page and its data
        for path in ("/dashboard", "/dashboard/data"):
            async with s.get(url + path) as r:
                assert r.status == 401
                assert _error_code(await r.read()) == "invalid_api_key"
        # a wrong key sets nothing
        async with s.get(url + "/dashboard", params={"key": "wrong"}, allow_redirects=False) as r:
            assert r.status == 401
            assert "Set-Cookie" not in r.headers
        # the right one: a 303 to the bare path and the cookie
        async with s.get(url + "/dashboard", params={"key": ADMIN_KEY}, allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/dashboard"
            assert r.headers["Cache-Control"] == "no-store"
            assert r.headers["Referrer-Policy"] == "no-referrer"
            morsel = _set_cookie(r)["kvgate_admin"]
        assert morsel["httponly"] is True
        assert morsel["samesite"] == "Strict"
        assert morsel["path"] == "/dashboard"
        assert morsel["max-age"] == "43200"
        assert not morsel["secure"]  # plain HTTP here; over TLS it is Secure (test below)
        cookie = {"Cookie": f"kvgate_admin={morsel.value}"}

        async with s.get(url + "/dashboard", headers=cookie) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/html; charset=utf-8"
            csp = r.headers["Content-Security-Policy"]
            assert "script-src 'self';" in csp
            assert "unsafe-inline" not in csp
            page = await r.text()
        assert '<script src="/dashboard/dashboard.js"' in page
        async with s.get(url + "/dashboard/data", headers=cookie) as r:
            assert r.status == 200
            assert r.headers["Cache-Control"] == "no-store"
            assert [b["name"] for b in (await r.json())["backends"]] == ["b0"]
        async with s.get(url + "/dashboard/data", headers=bearer(ADMIN_KEY)) as r:
            assert r.status == 200
        # a cookie with another key, and the cookie anywhere but the dashboard: refused
        async with s.get(url + "/dashboard/data", headers={"Cookie": "kvgate_admin=sk-nope"}) as r:
            assert r.status == 401
        async with s.get(url + "/admin/state", headers=cookie) as r:
            assert r.status == 401
        # the page's own files need no key and are the package's files, byte for byte
        files = resources.files("kvgate.dashboard")
        for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            async with s.get(f"{url}/dashboard/{name}") as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == f"{kind}; charset=utf-8"
                assert await r.read() == files.joinpath(name).read_bytes()
        async with s.post(url + "/dashboard", headers=cookie) as r:
            assert r.status == 405
        async with s.get(url + "/dashboard/other", headers=cookie) as r:
            assert r.status == 404


async def test_without_an_admin_key_the_dashboard_is_open() -> None:
    async with _gateway(admin=False) as (url, _gw, _model), aiohttp.ClientSession() as s:
        async with s.get(url + "/dashboard") as r:
            assert r.status == 200
        async with s.get(url + "/dashboard/data") as r:
            assert r.status == 200
        async with s.get(url + "/dashboard", params={"key": "x"}, allow_redirects=False) as r:
            assert r.status == 303
            assert "Set-Cookie" not in r.headers


async def test_over_tls_the_cookie_is_secure(tmp_path: Path) -> None:
    cert = self_signed(tmp_path)
    cfg = SimConfig.from_profile("tiny", speed=50, seed=1)
    async with run_sim(cfg) as engine:
        gateway = build_gateway(_config(engine.url, cfg.model), poll=False)
        ctx = server_context(str(cert.certificate), str(cert.key))
        async with (
            run_gateway(gateway, ssl_context=ctx) as url,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=cert.client_context())) as s,
            s.get(url + "/dashboard", params={"key": ADMIN_KEY}, allow_redirects=False) as r,
        ):
            assert r.status == 303
            assert _set_cookie(r)["kvgate_admin"]["secure"] is True


async def test_the_data_equals_the_admin_state_and_the_metrics() -> None:
    # one slot, a slow engine: a long stream holds the slot, a critical request waits in the
    # queue, a sheddable one (no wait) is refused
    async with _gateway(poll=True, speed=2) as (url, gw, model), aiohttp.ClientSession() as s:
        admin = bearer(ADMIN_KEY)

        async def data() -> dict[str, Any]:
            async with s.get(url + "/dashboard/data", headers=admin) as r:
                assert r.status == 200
                return await r.json()  # type: ignore[no-any-return]

        async def stream(key: str, tokens: int) -> int:
            body = chat(model, max_tokens=tokens, stream=True, ignore_eos=True)
            async with s.post(url + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
                await r.read()
                return r.status

        holder = asyncio.create_task(stream(KEYS["alice"], 200))
        await until(lambda: gw.controller.backend_state(0)["in_use"] == 1, timeout=10)
        waiter = asyncio.create_task(stream(KEYS["alice"], 4))
        await until(lambda: gw.queue is not None and gw.queue.waiting == 1, timeout=10)
        assert await stream(KEYS["batch"], 4) == 503

        d = await data()
        (b,) = d["backends"]
        assert b["queue"] == {"critical": 1, "standard": 0, "sheddable": 0}
        assert b["in_use"] == 1
        assert b["inflight_tokens"] > 0
        async with s.get(url + "/admin/state", headers=admin) as r:
            state = await r.json()
        st = state["backends"][0]
        assert b["base"] == {
            "concurrency": st["max_concurrency"],
            "tokens_per_minute": st["tokens_per_minute"],
            "inflight_tokens": st["inflight_token_limit"],
        }
        assert b["effective"] == {
            "concurrency": st["effective_concurrency"],
            "tokens_per_minute": st["effective_tokens_per_minute"],
            "inflight_tokens": st["effective_inflight_token_limit"],
        }
        assert b["inflight_tokens"] == st["inflight_tokens"]
        assert b["prefill"]["budget"] == state["prefill"]["b0"]["budget"]
        assert b["slo"] is None
        assert d["store"] == {"mode": "local"}
        assert {t["name"]: t["queue_depth"] for t in d["tenants"]} == {"alice": 1, "batch": 0}

        assert await holder == 200
        assert await waiter == 200
        await until(lambda: gw.controller.backend_state(0)["in_use"] == 0, timeout=10)
        d = await data()
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        (b,) = d["backends"]
        assert b["refusals"] == {"queued": metric(text, "kvgate_rejections_total", reason="queued")}
        hist = b["ttft"]["critical"]
        assert (
            hist["count"]
            == metric(text, "kvgate_upstream_ttft_seconds_count", **{"class": "critical"})
            == 2
        )
        bounds = [le for le, _ in hist["buckets"]]
        assert bounds == sorted(bounds)
        assert len(bounds) == 12
        for le, n in hist["buckets"]:
            assert n == metric(
                text, "kvgate_upstream_ttft_seconds_bucket", le=str(le), **{"class": "critical"}
            )
        tokens = {t["name"]: t["tokens"] for t in d["tenants"]}
        assert tokens["alice"] == metric(text, "kvgate_tenant_tokens_total", tenant="alice") > 200
        assert [t["name"] for t in d["tenants"]] == ["alice", "batch"]  # most tokens first
        assert b["queue"] == {"critical": 0, "standard": 0, "sheddable": 0}
        # nothing leaked
        assert b["in_use"] == 0
        assert b["inflight_tokens"] == 0


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/data"])
async def test_head_answers_like_get(path: str) -> None:
    async with _gateway() as (url, _gw, _model), aiohttp.ClientSession() as s:
        async with s.head(url + path, headers=bearer(ADMIN_KEY)) as r:
            assert r.status == 200


async def test_with_workers_the_counts_are_summed_over_them() -> None:
    """``kvgate serve --workers 2``: requests on fresh connections spread over both workers
    (``SO_REUSEPORT``); whichever worker answers ``/dashboard/data``, the tokens it shows are
    every worker's, equal to the usage the clients were told and to ``/metrics``."""
    config = {
        "workers": 2,
        "admin_key_sha256": sha(ADMIN_KEY),
        "tenants": [{"name": "alice", "api_key_sha256": [sha(KEYS["alice"])]}],
    }
    async with run_replicas(config, n=1, admin_key=ADMIN_KEY) as gws:
        used = 0
        for i in range(20):  # a new client, so a new connection, for each request
            async with openai.AsyncOpenAI(
                base_url=gws.base_url(0), api_key=KEYS["alice"], max_retries=0
            ) as client:
                answer = await client.chat.completions.create(
                    model=gws.model,
                    messages=[{"role": "user", "content": f"request {i}"}],
                    max_tokens=8,
                )
            assert answer.usage is not None
            used += answer.usage.total_tokens

        async def summed() -> bool:
            async with (
                aiohttp.ClientSession() as s,
                s.get(gws.url(0) + "/dashboard/data", headers=bearer(ADMIN_KEY)) as r,
            ):
                data = await r.json()
            text = await gws.metrics(0)
            (alice,) = [t for t in data["tenants"] if t["name"] == "alice"]
            return bool(
                alice["tokens"]
                == used
                == metric(text, "kvgate_tenant_tokens_total", tenant="alice")
            )

        await until(summed, timeout=15, interval=0.2)
