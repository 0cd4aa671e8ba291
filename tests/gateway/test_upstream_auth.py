"""A backend's own API key: sent to the engine on every route kvgate calls (inference, other
``/v1/`` routes, metrics, health); the client's key never reaches an engine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from tests.gateway.fake_upstream import serve_app

from kvgate.config import Config, ConfigError, parse_config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import sha
from .helpers import until

KEY_VAR = "KVGATE_TEST_ENGINE_KEY"
ENGINE_KEY = "engine-secret-0123"
#: what a client sends: its own gateway key in both forms, and the old bypass header
CLIENT_HEADERS = {
    "Authorization": "Bearer sk-alice",
    "api-key": "sk-alice",
    "X-Upstream-Authorization": "Bearer stolen-engine-key",
}


@dataclass
class RecordingEngine:
    """A fake engine that records the headers of every request, by path."""

    url: str = ""
    seen: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def record(self, request: web.Request) -> None:
        self.seen.setdefault(request.path, []).append(dict(request.headers))


def _engine_app(state: RecordingEngine) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        state.record(request)
        body = orjson.loads(await request.read())
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 1,
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    async def other(request: web.Request) -> web.Response:
        state.record(request)
        if request.path == "/metrics":
            return web.Response(
                text="# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n',
                content_type="text/plain",
            )
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


@contextlib.asynccontextmanager
async def run_engine() -> AsyncIterator[RecordingEngine]:
    state = RecordingEngine()
    async with serve_app(_engine_app(state), handler_cancellation=False) as state.url:
        yield state


def _data(url: str, **backend: Any) -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "b0",
                "url": url,
                "models": [{"name": "m", "context_window": 1024}],
                "max_concurrency": 4,
                "engine": "vllm",
                "adaptive": {"enabled": True, "poll_interval": 0.05, "stale_after": 0.5},
                **backend,
            }
        ],
        "tenants": [{"name": "alice", "api_key_sha256": [sha("sk-alice")]}],
        "other_routes": "forward",  # so the passthrough call reaches the engine
    }


async def _drive(url: str) -> None:
    """A chat call (whole and streamed) and a forwarded call (``other_routes: forward``), with
    the client's headers."""
    async with aiohttp.ClientSession() as s:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for body in (chat, {**chat, "stream": True}):
            async with s.post(url + "/v1/chat/completions", json=body, headers=CLIENT_HEADERS) as r:
                assert r.status == 200, await r.text()
                await r.read()
        async with s.get(url + "/v1/files", headers=CLIENT_HEADERS) as r:
            assert r.status == 200, await r.text()


def _no_client_key(headers: dict[str, str]) -> None:
    lowered = {k.lower(): v for k, v in headers.items()}
    assert "api-key" not in lowered
    assert "x-upstream-authorization" not in lowered
    assert "sk-alice" not in str(lowered)
    assert "stolen-engine-key" not in str(lowered)


async def test_the_backends_key_reaches_every_engine_route_and_the_clients_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_VAR, ENGINE_KEY)
    async with run_engine() as engine:
        config = Config.model_validate(_data(engine.url, api_key_env=KEY_VAR))
        gateway = build_gateway(config, poll=True)
        async with run_gateway(gateway) as url:
            await _drive(url)
            await until(lambda: "/metrics" in engine.seen and "/health" in engine.seen)
        assert gateway.controller.backend_state(0)["in_use"] == 0
    routes = ("/v1/chat/completions", "/v1/files", "/metrics", "/health")
    for path in routes:
        assert engine.seen.get(path), path
        for headers in engine.seen[path]:
            assert headers.get("Authorization") == f"Bearer {ENGINE_KEY}", (path, headers)
            _no_client_key(headers)
    assert len(engine.seen["/v1/chat/completions"]) == 2


async def test_without_a_backend_key_no_authorization_reaches_the_engine() -> None:
    """No key configured: the engine sees no ``Authorization`` at all — not the client's, and
    not one smuggled in ``X-Upstream-Authorization``."""
    async with run_engine() as engine:
        gateway = build_gateway(Config.model_validate(_data(engine.url)), poll=True)
        async with run_gateway(gateway) as url:
            await _drive(url)
            await until(lambda: "/metrics" in engine.seen and "/health" in engine.seen)
    for path, seen in engine.seen.items():
        for headers in seen:
            assert "Authorization" not in headers, (path, headers)
            _no_client_key(headers)


def test_api_key_env_is_validated() -> None:
    url = "http://127.0.0.1:9"

    def issues(value: Any, env: dict[str, str]) -> list[tuple[str, str]]:
        with pytest.raises(ConfigError) as info:
            parse_config(_data(url, api_key_env=value), env=env)
        return info.value.issues

    assert issues(KEY_VAR, {}) == [
        ("backends[0].api_key_env", f"environment variable {KEY_VAR} is not set")
    ]
    assert issues(KEY_VAR, {KEY_VAR: ""}) == [
        ("backends[0].api_key_env", f"environment variable {KEY_VAR} is empty")
    ]
    [(path, message)] = issues("1BAD-NAME", {})
    assert path == "backends[0].api_key_env"
    assert "must name an environment variable" in message
    [(path, message)] = issues(KEY_VAR, {KEY_VAR: "two words"})
    assert "space, control or non-ASCII" in message
    assert "two words" not in message  # the key itself is never echoed
    cfg = parse_config(_data(url, api_key_env=KEY_VAR), env={KEY_VAR: ENGINE_KEY})
    assert cfg.backends[0].api_key == ENGINE_KEY
    assert ENGINE_KEY not in repr(cfg)
    assert ENGINE_KEY not in cfg.model_dump_json()
    assert parse_config(_data(url), env={}).backends[0].api_key is None


def test_check_config_reports_a_missing_key_variable(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(orjson.dumps(_data("http://127.0.0.1:9", api_key_env=KEY_VAR)).decode())
    env = {k: v for k, v in os.environ.items() if k != KEY_VAR}
    cmd = [sys.executable, "-m", "kvgate", "check-config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2
    assert f"backends[0].api_key_env: environment variable {KEY_VAR} is not set" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, KEY_VAR: ENGINE_KEY},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert ENGINE_KEY not in done.stdout + done.stderr
    # serve refuses the file the same way at start
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2
    assert f"environment variable {KEY_VAR} is not set" in done.stderr


def _moving_engine(thief: RecordingEngine) -> web.Application:
    """An engine that answers every request with a redirect to ``thief`` (as a moved engine,
    or a proxy in front of one, may), setting a cookie on the way."""

    async def moved(request: web.Request) -> web.Response:
        thief.record(request)  # recorded as seen by the engine, under its own path
        status = 307 if request.method == "POST" else 302
        return web.Response(
            status=status,
            headers={
                "Location": thief.url + request.path,
                "Set-Cookie": "session=one-tenants-secret; Path=/",
            },
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", moved)
    return app


async def test_an_engines_redirect_is_not_followed_and_its_cookie_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3xx from the engine is a 502 ``upstream_redirect``: neither the prompt nor the
    backend's key goes to the host it names, and the request's slot goes back. A cookie an
    engine sets (a load balancer's affinity cookie, say) rides on no later request: one
    tenant's answer must not shape what the engine sees of another's."""
    monkeypatch.setenv(KEY_VAR, ENGINE_KEY)
    thief = RecordingEngine()
    engine = RecordingEngine()
    async with (
        serve_app(_engine_app(thief), handler_cancellation=False) as thief.url,
        serve_app(_moving_engine(engine), handler_cancellation=False) as engine.url,
    ):
        # a host name, not an address: aiohttp's cookie jar keeps no cookie of an IP host
        url = engine.url.replace("127.0.0.1", "localhost")
        gateway = build_gateway(Config.model_validate(_data(url, api_key_env=KEY_VAR)))
        async with run_gateway(gateway) as gw, aiohttp.ClientSession() as s:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for body in (chat, {**chat, "stream": True}, chat):
                async with s.post(
                    gw + "/v1/chat/completions", json=body, headers=CLIENT_HEADERS
                ) as r:
                    assert r.status == 502, await r.text()
                    error = (await r.json())["error"]
                    assert error["code"] == "upstream_redirect"
                    assert "307" in error["message"]
                    assert "Location" not in r.headers
            async with s.get(gw + "/v1/files", headers=CLIENT_HEADERS) as r:
                assert r.status == 502
                assert (await r.json())["error"]["code"] == "upstream_redirect"
            assert gateway.controller.backend_state(0)["in_use"] == 0
    assert thief.seen == {}
    calls = engine.seen["/v1/chat/completions"]
    assert len(calls) == 3
    for headers in calls + engine.seen["/v1/files"]:
        assert headers.get("Authorization") == f"Bearer {ENGINE_KEY}"
        assert "Cookie" not in headers, headers
