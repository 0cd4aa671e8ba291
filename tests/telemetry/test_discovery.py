"""Zero-configuration discovery against scripted engines shaped like llama.cpp, vLLM, TGI and
SGLang (each answering only its own endpoints) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvgate.telemetry.discovery import DiscoveryError, discover_engine, llamacpp_unified

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
Routes = dict[tuple[str, str], tuple[int, Any]]


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(
        routes: Routes, *, api_key: str | None = None, seen: list[str | None] | None = None
    ) -> str:
        """An engine answering ``routes``; with ``api_key``, 401 to any request without it
        (``seen`` collects every request's ``Authorization`` header)."""

        async def handler(request: web.Request) -> web.Response:
            auth = request.headers.get("Authorization")
            if seen is not None:
                seen.append(auth)
            if api_key is not None and auth != f"Bearer {api_key}":
                return web.json_response({"error": {"message": "Invalid API Key"}}, status=401)
            status, body = routes.get((request.method, request.path), (404, {"error": "nf"}))
            if isinstance(body, str):
                return web.Response(status=status, text=body)
            return web.json_response(body, status=status, dumps=json.dumps)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


def _llamacpp(slot_ctx: int, n_ctx_train: int, slots: int = 4) -> Routes:
    """llama-server's answers (this build: no KV metric, /metrics off)."""
    return {
        ("GET", "/v1/models"): (
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": "m",
                        "object": "model",
                        "owned_by": "llamacpp",
                        "meta": {"n_ctx": slot_ctx, "n_ctx_train": n_ctx_train},
                    }
                ],
            },
        ),
        ("GET", "/metrics"): (501, {"error": {"code": 501, "message": "metrics off"}}),
        ("GET", "/props"): (
            200,
            {
                "total_slots": slots,
                "default_generation_settings": {"n_ctx": slot_ctx},
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                "bos_token": "<s>",
            },
        ),
        ("POST", "/tokenize"): (200, {"tokens": [1]}),
        ("GET", "/slots"): (
            200,
            [{"id": i, "n_ctx": slot_ctx, "is_processing": False} for i in range(slots)],
        ),
    }


async def test_llamacpp_per_slot_kv(serve: Any) -> None:
    url = await serve(_llamacpp(slot_ctx=1024, n_ctx_train=8192))
    info = await asyncio.to_thread(discover_engine, url)
    assert info.engine == "llamacpp"
    assert info.sources["engine"] == "GET /v1/models owned_by 'llamacpp'"
    assert [(m.name, m.context_window) for m in info.models] == [("m", 1024)]
    assert info.models[0].source == "GET /v1/models meta.n_ctx"
    assert (info.slots, info.sources["slots"]) == (4, "GET /props total_slots")
    assert (info.kv_unified, info.kv_capacity_tokens) == (False, 4 * 1024)
    # the engine adds BOS in front of the rendered template: so does the discovered one
    assert info.chat_template == "<s>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert "engine: llamacpp" in info.describe()
    assert info.as_dict()["chat_template"] == len(info.chat_template)


async def test_llamacpp_unified_default(serve: Any) -> None:
    """Started without --parallel: 4 slots that each see the whole (training) context share
    one pool, so the capacity is one slot's context, not four."""
    routes = _llamacpp(slot_ctx=8192, n_ctx_train=8192)
    routes[("POST", "/tokenize")] = (200, {"tokens": []})  # a vocabulary without BOS
    url = await serve(routes)
    info = await asyncio.to_thread(discover_engine, url)
    assert (info.kv_unified, info.kv_capacity_tokens) == (True, 8192)
    assert info.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_unified_rule() -> None:
    assert llamacpp_unified(4, 8192, 8192)
    assert not llamacpp_unified(4, 2048, 8192)
    assert not llamacpp_unified(1, 8192, 8192)  # one slot: the same either way
    assert not llamacpp_unified(4, 8192, None)


async def test_llamacpp_detected_by_props_without_owned_by(serve: Any) -> None:
    routes = _llamacpp(slot_ctx=512, n_ctx_train=4096, slots=2)
    routes[("GET", "/v1/models")] = (200, {"data": [{"id": "m"}]})
    url = await serve(routes)
    info = await asyncio.to_thread(discover_engine, url)
    assert (info.engine, info.sources["engine"]) == ("llamacpp", "GET /props total_slots")
    assert info.models[0].context_window == 512
    assert info.models[0].source == "GET /props default_generation_settings.n_ctx"
    assert (info.slots, info.kv_capacity_tokens) == (2, 1024)


async def test_vllm(serve: Any) -> None:
    url = await serve(
        {
            ("GET", "/v1/models"): (
                200,
                {"data": [{"id": "llama", "owned_by": "vllm", "max_model_len": 4096}]},
            ),
            ("GET", "/metrics"): (
                200,
                (FIXTURES / "vllm-v0-0.7-aibrix-runtime-docs.prom").read_text(),
            ),
        }
    )
    info = await asyncio.to_thread(discover_engine, url)
    assert info.engine in ("vllm", "vllm-v0")
    assert info.sources["engine"] == "GET /metrics metric names"
    assert info.models[0].context_window == 4096
    assert info.slots is None  # vLLM states no batch limit over HTTP
    assert info.kv_capacity_tokens == 81767 * 16
    assert info.sources["kv_capacity_tokens"].startswith("GET /metrics vllm:cache_config_info")


async def test_tgi(serve: Any) -> None:
    url = await serve(
        {
            ("GET", "/v1/models"): (200, {"data": [{"id": "tgi-model", "owned_by": "x"}]}),
            ("GET", "/info"): (
                200,
                {
                    "model_id": "tgi-model",
                    "max_concurrent_requests": 128,
                    "max_input_tokens": 4095,
                    "max_total_tokens": 4096,
                },
            ),
        }
    )
    info = await asyncio.to_thread(discover_engine, url)
    assert (info.engine, info.slots) == ("tgi", 128)
    assert info.models[0].context_window == 4096
    assert info.models[0].source == "GET /info max_total_tokens"


async def test_sglang(serve: Any) -> None:
    url = await serve(
        {
            ("GET", "/v1/models"): (200, {"data": [{"id": "s", "owned_by": "sglang"}]}),
            ("GET", "/get_server_info"): (
                200,
                {"max_running_requests": 48, "context_length": 32768, "max_total_num_tokens": 9000},
            ),
        }
    )
    info = await asyncio.to_thread(discover_engine, url)
    assert (info.engine, info.slots, info.kv_capacity_tokens) == ("sglang", 48, 9000)
    assert info.models[0].context_window == 32768
    assert info.prefill_chunk_tokens is None  # not stated


@pytest.mark.parametrize(
    ("server_info", "chunk", "source"),
    [
        # chunked prefill on: one chunk per step
        (
            {"chunked_prefill_size": 8192, "max_prefill_tokens": 16384},
            8192,
            "chunked_prefill_size",
        ),
        # -1 turns chunked prefill off: one prefill batch's token budget instead
        ({"chunked_prefill_size": -1, "max_prefill_tokens": 16384}, 16384, "max_prefill_tokens"),
        # the arguments nested under server_args (some versions)
        ({"server_args": {"chunked_prefill_size": 4096}}, 4096, "chunked_prefill_size"),
        # garbage is not a chunk
        ({"chunked_prefill_size": "8192", "max_prefill_tokens": True}, None, None),
    ],
)
async def test_sglang_prefill_chunk(
    serve: Any, server_info: dict[str, Any], chunk: int | None, source: str | None
) -> None:
    """SGLang states how many prompt tokens it prefills in one step; kvgate sizes the default
    prefill budget from it."""
    url = await serve(
        {
            ("GET", "/v1/models"): (200, {"data": [{"id": "s", "owned_by": "sglang"}]}),
            ("GET", "/get_server_info"): (200, {"max_running_requests": 8, **server_info}),
        }
    )
    info = await asyncio.to_thread(discover_engine, url)
    assert info.prefill_chunk_tokens == chunk
    if source is None:
        assert "prefill_chunk_tokens" not in info.sources
        assert "prefill chunk" not in info.describe()
    else:
        assert info.sources["prefill_chunk_tokens"] == f"GET /get_server_info {source}"
        assert f"prefill chunk: {chunk} tokens" in info.describe()


def test_default_prefill_budget_is_twice_the_discovered_chunk() -> None:
    """A backend without a configured prefill_token_budget gets twice the engine's stated chunk
    (else 3 % of its KV capacity); a configured budget wins over both."""
    from kvgate.config import Config
    from kvgate.gateway_build import build_gateway
    from kvgate.telemetry.discovery import EngineInfo

    url = "http://127.0.0.1:9"

    def budget(chunk: int | None, configured: int | None = None) -> int | None:
        backend: dict[str, Any] = {
            "name": "b0",
            "url": url,
            "models": [{"name": "m", "context_window": 8192}],
            "max_concurrency": 4,
        }
        if configured is not None:
            backend["prefill_token_budget"] = configured
        config = Config.model_validate({"backends": [backend]})
        info = EngineInfo(
            url=url, engine="sglang", slots=4, kv_capacity_tokens=1_000_000,
            prefill_chunk_tokens=chunk,
        )  # fmt: skip
        gw = build_gateway(config, poll=False, discovery={"b0": info})
        gate = gw.prefill.get("b0")
        return None if gate is None else gate.budget

    assert budget(8192) == 16384
    assert budget(None) == 30_000  # 3 % of 1,000,000 KV tokens
    assert budget(8192, configured=5000) == 5000
    assert budget(8192, configured=0) is None


async def test_models_are_required(serve: Any) -> None:
    url = await serve({("GET", "/v1/models"): (500, {"error": "boom"})})
    with pytest.raises(DiscoveryError, match="cannot list models"):
        await asyncio.to_thread(discover_engine, url)
    with pytest.raises(DiscoveryError, match="cannot list models"):
        await asyncio.to_thread(discover_engine, "http://127.0.0.1:9", timeout=2)


def test_gateway_uses_what_was_discovered() -> None:
    """``engine: auto`` reads llama.cpp's /slots too (once the metrics name llama.cpp), with
    the unified-pool flag; the discovered KV capacity is the in-flight budget from the start."""
    from kvgate.adaptive import poll_targets
    from kvgate.config import Config
    from kvgate.gateway_build import build_gateway
    from kvgate.telemetry.discovery import EngineInfo

    url = "http://127.0.0.1:9"
    config = Config.model_validate(
        {
            "backends": [
                {
                    "name": "b0",
                    "url": url,
                    "models": [{"name": "m", "context_window": 8192}],
                    "max_concurrency": 4,
                }
            ]
        }
    )
    info = EngineInfo(url=url, engine="llamacpp", slots=4, kv_capacity_tokens=8192, kv_unified=True)
    gw = build_gateway(config, poll=False, discovery={"b0": info})
    [target] = poll_targets(gw)
    assert (target.engine, target.slots_url, target.kv_unified) == ("auto", url + "/slots", True)
    state = gw.controller.backend_state(gw.backends[0].id)
    assert state["inflight_token_limit"] == int(8192 * 0.9)
    assert gw.discovery["b0"] is info


def test_slot_limit_follows_the_engines_slots_on_each_poll() -> None:
    """A slot limit taken from the engine follows it when a poll sees another slot count
    (llama.cpp restarted with another --parallel); a configured limit does not."""
    from kvgate.adaptive import AdaptiveSink
    from kvgate.config import Config
    from kvgate.gateway_build import build_gateway
    from kvgate.telemetry.discovery import EngineInfo
    from kvgate.telemetry.engine_metrics import parse_llamacpp_slots, read_engine_metrics

    def gateway(max_concurrency: int) -> Any:
        url = "http://127.0.0.1:9"
        config = Config.model_validate(
            {
                "backends": [
                    {
                        "name": "b0",
                        "url": url,
                        "models": [{"name": "m", "context_window": 1024}],
                        "max_concurrency": max_concurrency,
                    }
                ]
            }
        )
        info = EngineInfo(url=url, engine="llamacpp", slots=4)
        return build_gateway(config, poll=False, discovery={"b0": info})

    two_slots = parse_llamacpp_slots(
        [{"id": i, "n_ctx": 2048, "is_processing": False} for i in range(2)]
    )
    reading = read_engine_metrics(
        (FIXTURES / "llamacpp-mainline-no-kv-metrics.prom").read_text(), slots=two_slots
    )
    assert (reading.slots, reading.sources["slots"]) == (2, "GET /slots (entries)")
    for configured, after in ((4, 2), (8, 8)):
        gw = gateway(configured)
        AdaptiveSink(gw).on_reading("b0", reading, 0.0)
        assert gw.controller.backend_state(gw.backends[0].id)["max_concurrency"] == after


async def test_an_engine_with_an_api_key_is_asked_with_it(serve: Any) -> None:
    """An engine started with an API key answers nothing without it (``/v1/models`` 401); with
    ``api_key`` every question carries ``Authorization: Bearer <key>`` and the engine's slots
    are found."""
    seen: list[str | None] = []
    routes = _llamacpp(slot_ctx=4096, n_ctx_train=32768, slots=6)
    url = await serve(routes, api_key="engine-key", seen=seen)
    with pytest.raises(DiscoveryError, match="401"):
        await asyncio.to_thread(discover_engine, url)
    seen.clear()
    info = await asyncio.to_thread(discover_engine, url, api_key="engine-key")
    assert (info.engine, info.slots) == ("llamacpp", 6)
    assert info.kv_capacity_tokens == 6 * 4096
    assert set(seen) == {"Bearer engine-key"}  # every question carried it


@pytest.mark.parametrize("stated", [0, -4, "4", True, 4.0, None, [4], 2**63])
async def test_a_garbage_slot_count_is_not_a_slot_limit(serve: Any, stated: Any) -> None:
    """``total_slots`` that is not a positive integer the core can hold (zero, negative, a
    string, a bool, a float, a list, more than 2**62) states nothing: the slot limit falls
    back to the default instead of failing the start."""
    routes = _llamacpp(slot_ctx=4096, n_ctx_train=32768)
    props = dict(routes[("GET", "/props")][1])
    props["total_slots"] = stated
    routes[("GET", "/props")] = (200, props)
    routes[("GET", "/slots")] = (404, {"error": "nf"})
    url = await serve(routes)
    info = await asyncio.to_thread(discover_engine, url)
    assert info.engine == "llamacpp"
    assert info.slots is None
