"""Every route admitted and accounted: path normalisation, ``POST /v1/responses``,
``GET /v1/models/{id}``, and the ``other_routes`` policy (refuse / forward) — through the real
gateway on loopback, with the official ``openai`` client where it has the call."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.config import Config, ConfigError, load_config
from kvgate.proxy.routes import RouteKind, normalize_path, route_of
from kvgate.sim import SimConfig, run_sim

from .conftest import config_for, sha
from .fake_routes import FORWARD_USAGE, RESPONSES_USAGE, run_routes_engine
from .helpers import bearer, get_text, metric, until

KEY = "sk-routes"


def _with_tenant(cfg: Config, **tenant: Any) -> Config:
    """``cfg`` with one keyed tenant ``alice`` (a TPM bucket that refills 1 token a second)."""
    data = cfg.model_dump()
    data["tenants"] = [
        {
            "name": "alice",
            "api_key_sha256": [sha(KEY)],
            "tokens_per_minute": 60,
            "burst_tokens": 100_000,
            **tenant,
        }
    ]
    return Config.model_validate(data)


def _forwarding(cfg: Config) -> Config:
    return cfg.model_copy(update={"other_routes": "forward"})


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)


async def _raw(
    s: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    """One request over a raw path (``aiohttp`` keeps ``//`` and trailing ``/`` as given)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {**bearer(KEY), "Content-Type": "application/json"}
    async with s.request(method, url, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def test_a_tenant_at_its_tpm_limit_gets_nothing_through_any_path(gateway_for) -> None:
    """Once a tenant's bucket is spent, every spelling of an inference route, the Responses API
    and a forwarded route are all refused with 429 ``tenant-tpm``, and the engine sees none."""
    async with run_routes_engine() as engine:
        cfg = _forwarding(_with_tenant(config_for(engine.url, ["m"]), burst_tokens=2_000))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            # a trailing slash is the chat route: analysed, admitted, sent to the canonical path
            engine.chat_usage = {"prompt_tokens": 3_000, "completion_tokens": 1_000}
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            status, _, _ = await _raw(s, "POST", gw.url + "/v1/chat/completions/", body)
            assert status == 200
            assert engine.seen[0][:2] == ("POST", "/v1/chat/completions")
            # the engine's usage (4,000) was charged: the bucket is in debt
            assert gw.tenant_state("alice")["available_tokens"] < 0
            attempts = [
                ("/v1/chat/completions/", body),
                ("//v1//chat/completions", body),
                ("/v1/chat/completions", body),
                # llama.cpp's other spelling of the chat route: inference too
                ("/chat/completions", body),
                ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 8}),
                ("/v1/rerank", {"model": "m", "query": "q", "documents": ["d"]}),
                ("/v1/score", None),
            ]
            for path, payload in attempts:
                status, headers, raw = await _raw(s, "POST", gw.url + path, payload)
                assert status == 429, (path, raw)
                assert headers["x-kvgate-reject-reason"] == "tenant-tpm", path
                assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
            assert len(engine.seen) == 1  # nothing else reached the engine
            assert gw.tenant_state("alice")["in_use"] == 0
            assert gw.backend_state()["in_use"] == 0


async def test_normalised_paths_are_inference_requests(gateway_for) -> None:
    """``//v1//chat/completions`` and ``/v1/chat/completions/`` are counted like the route
    itself (metrics, tokens), and a wrong method on them is still 405."""
    async with run_routes_engine() as engine:
        cfg = _with_tenant(config_for(engine.url, ["m"]))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            paths = (
                "//v1//chat/completions",
                "/v1/chat/completions/",
                "/v1//embeddings/",
                "/chat/completions",  # without /v1, as llama.cpp's server also answers it
            )
            for path in paths:
                payload = {"model": "m", "input": "x"} if "embeddings" in path else body
                status, _, _ = await _raw(s, "POST", gw.url + path, payload)
                assert status == 200, path
            assert [p for _, p, _ in engine.seen] == [
                "/v1/chat/completions",
                "/v1/chat/completions",
                "/v1/embeddings",
                "/v1/chat/completions",
            ]
            gw.gateway.metrics.flush()
            text = await get_text(gw.url + "/metrics")
            assert metric(text, "kvgate_requests_total", tenant="alice", outcome="ok") == 4
            # 5 + 1 tokens of usage per chat request and 30 for the embeddings, charged
            assert metric(text, "kvgate_tenant_tokens_total", tenant="alice") == 48
            for method, path in (("GET", "/v1/chat/completions/"), ("PUT", "//v1/responses")):
                status, headers, raw = await _raw(s, method, gw.url + path)
                assert status == 405, path
                assert headers["Allow"] == "POST"
                assert json.loads(raw)["error"]["code"] == "method_not_allowed"
            assert len(engine.seen) == 4


async def test_responses_stream_arrives_incrementally_and_is_reconciled(gateway_for) -> None:
    """The first events of a Responses stream reach the client while the engine is still
    paused mid-stream; the reservation (prompt + ``max_output_tokens``) is then reconciled with
    the usage of ``response.completed``."""
    async with run_routes_engine() as engine:
        cfg = _with_tenant(config_for(engine.url, ["pause"], context_window=4096))
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            stream = await client.responses.create(
                model="pause", input="hello", max_output_tokens=2_000, stream=True
            )
            kinds: list[str] = []
            deltas: list[str] = []
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                    if len(deltas) == 1:
                        # the engine has not finished: the gateway relays as it arrives
                        assert engine.finished == 0
                        assert gw.backend_state()["in_use"] == 1
                        reserved = gw.backend_state()["inflight_tokens"]
                        assert reserved > 2_000
                        engine.release.set()
                if event.type == "response.completed":
                    assert event.response.usage is not None
                    assert event.response.usage.output_tokens == RESPONSES_USAGE["output_tokens"]
            assert kinds[0] == "response.created"
            assert kinds[-1] == "response.completed"
            assert "".join(deltas) == "abc"
            await until(lambda: gw.backend_state()["in_use"] == 0)
            assert gw.backend_state()["inflight_tokens"] == 0
            spent = 100_000 - gw.tenant_state("alice")["available_tokens"]
            # charged the engine's 43 tokens (the bucket refills 1 token a second meanwhile),
            # not the 2,000+ reserved
            assert 43 - 30 <= spent <= 43, spent
            # not asked for usage with stream_options: a Responses stream always ends with it
            sent = json.loads(engine.seen[-1][2])
            assert "stream_options" not in sent


async def test_responses_stream_disconnect_releases_and_charges_delivered(gateway_for) -> None:
    """A client that goes away mid-Responses-stream frees its slot at once, the engine's
    request is aborted, and the tenant pays the prompt plus the delivered deltas only."""
    async with run_routes_engine() as engine:
        cfg = _with_tenant(config_for(engine.url, ["slow"], context_window=8192))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            body = {"model": "slow", "input": "hello there", "max_output_tokens": 5_000}
            prompt = gw.gateway.registry.analyze("/v1/responses", json.dumps(body).encode())
            resp = await s.post(
                gw.url + "/v1/responses", json={**body, "stream": True}, headers=bearer(KEY)
            )
            assert resp.status == 200
            seen = 0
            while seen < 3:
                line = await resp.content.readline()
                seen += line.startswith(b"data:") and b"output_text.delta" in line
            assert gw.backend_state()["in_use"] == 1
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            resp.close()
            await until(lambda: gw.backend_state()["in_use"] == 0, timeout=5)
            assert loop.time() - t0 < 2  # at once, not at the end of the 10 s stream
            await until(lambda: engine.cancelled == 1, timeout=5)
            assert gw.backend_state()["inflight_tokens"] == 0
            spent = 100_000 - gw.tenant_state("alice")["available_tokens"]
            # prompt + at least the three deltas read ("word " = 2 tokens by the byte
            # estimate each), far below the reservation of prompt + 5,000
            assert prompt.prompt_tokens + 6 - 10 <= spent <= prompt.prompt_tokens + 150, spent
            assert spent < prompt.reserved_tokens // 10


async def test_responses_non_streamed_settles_from_usage_or_counted_text(gateway_for) -> None:
    """A whole Responses answer is settled from its top-level ``usage``
    (``input_tokens``/``output_tokens``), or, without one, from its ``output`` text counted."""
    async with run_routes_engine() as engine:
        # the engine's own non-streamed answers (not assembled from a stream)
        cfg = _with_tenant(
            config_for(engine.url, ["pause", "nousage"], context_window=4096, stream_upstream=False)
        )
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            answer = await client.responses.create(model="pause", input="hi", max_output_tokens=900)
            assert answer.output_text == "abc"
            assert answer.usage is not None
            assert answer.usage.total_tokens == 43
            spent = 100_000 - gw.tenant_state("alice")["available_tokens"]
            assert 43 - 30 <= spent <= 43, spent
            body = {"model": "nousage", "input": "hi", "max_output_tokens": 900}
            prompt = gw.gateway.registry.analyze("/v1/responses", json.dumps(body).encode())
            before = gw.tenant_state("alice")["available_tokens"]
            answer = await client.responses.create(**body)  # type: ignore[call-overload]
            assert answer.usage is None
            charged = before - gw.tenant_state("alice")["available_tokens"]
            # our prompt count + the 40-byte output text (10 tokens by the byte estimate)
            assert prompt.prompt_tokens + 10 - 30 <= charged <= prompt.prompt_tokens + 10
            assert gw.backend_state()["inflight_tokens"] == 0


async def test_responses_api_through_the_simulator(gateway_for) -> None:
    """The ``openai`` client's Responses calls against the simulator behind the gateway:
    streamed (named events, ``response.completed`` usage) and not; both settled."""
    async with run_sim(SimConfig.from_profile("tiny", speed=50)) as sim:
        model = sim.engine.config.model
        cfg = _with_tenant(config_for(sim.url, [model], context_window=1024))
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            answer = await client.responses.create(
                model=model,
                instructions="be brief",
                input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                max_output_tokens=20,
            )
            assert answer.output_text
            assert answer.usage is not None
            assert 1 <= answer.usage.output_tokens <= 20
            stream = await client.responses.create(
                model=model, input="hello", max_output_tokens=12, stream=True
            )
            kinds = [event.type async for event in stream]
            assert kinds[0] == "response.created"
            assert "response.output_text.delta" in kinds
            assert kinds[-1] in ("response.completed", "response.incomplete")
            await until(lambda: gw.backend_state()["in_use"] == 0)
            assert gw.backend_state()["inflight_tokens"] == 0
            gw.gateway.metrics.flush()
            text = await get_text(gw.url + "/metrics")
            assert metric(text, "kvgate_requests_total", tenant="alice", outcome="ok") == 2


async def test_models_retrieve(gateway_for) -> None:
    """``GET /v1/models/{id}``: the model object (also an id with ``/``, which the client
    sends as ``%2F``); an unknown id is a 404 ``model_not_found`` in OpenAI's shape."""
    async with run_routes_engine() as engine:
        cfg = config_for(engine.url, ["m", "org/model-a"], context_window=2048)
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            model = await client.models.retrieve("org/model-a")
            assert (model.id, model.object) == ("org/model-a", "model")
            assert model.model_extra is not None
            assert model.model_extra["max_model_len"] == 2048
            assert (await client.models.retrieve("m")).id == "m"
            with pytest.raises(openai.NotFoundError) as err:
                await client.models.retrieve("nope")
            assert err.value.code == "model_not_found"
            assert set(err.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
            async with aiohttp.ClientSession() as s:
                async with s.delete(gw.url + "/v1/models/m") as r:
                    assert r.status == 405
            assert engine.seen == []


async def test_other_routes_refuse_by_default(gateway_for) -> None:
    """``other_routes: refuse`` (the default): 404 naming the method and path, nothing read
    upstream, nothing held."""
    async with run_routes_engine() as engine:
        cfg = _with_tenant(config_for(engine.url, ["m"]))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            for method, path in (
                ("POST", "/v1/rerank"),
                ("GET", "/v1/files"),
                ("POST", "/tokenize"),
            ):
                status, _, raw = await _raw(s, method, gw.url + path, {"model": "m"})
                assert status == 404
                err = json.loads(raw)["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "unknown_url"
                assert f"{method} {path}" in err["message"]
            assert engine.seen == []
            assert gw.backend_state()["in_use"] == 0
            assert gw.tenant_state("alice")["in_use"] == 0
            assert gw.tenant_state("alice")["available_tokens"] >= 100_000 - 1


async def test_other_routes_forward_admits_streams_and_charges(gateway_for) -> None:
    """``other_routes: forward``: admitted against the tenant's limits (a second request over
    its concurrency is refused while the first is held), the answer streamed as it arrives, the
    engine's usage charged, the request counted in the metrics."""
    async with run_routes_engine() as engine:
        cfg = _forwarding(_with_tenant(config_for(engine.url, ["m"]), max_concurrency=1))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            # a JSON body naming a model: routed like inference; method and query string kept
            status, _, raw = await _raw(s, "POST", gw.url + "/v1/rerank/?top=2", {"model": "m"})
            assert status == 200
            assert json.loads(raw)["usage"] == FORWARD_USAGE
            assert engine.seen[-1][:2] == ("POST", "/v1/rerank?top=2")
            spent = 100_000 - gw.tenant_state("alice")["available_tokens"]
            assert 30 - 30 < spent <= 30, spent  # the engine's prompt_tokens
            # streamed as it arrives: the first part reaches the client before the engine ends
            resp = await s.get(gw.url + "/v1/paused", headers=bearer(KEY))
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readany(), 10)
            assert first.startswith(b'{"part": 1')
            assert gw.tenant_state("alice")["in_use"] == 1
            assert gw.backend_state()["in_use"] == 1
            # the tenant's concurrency limit holds for forwarded routes
            status, headers, _ = await _raw(s, "POST", gw.url + "/v1/score", {"model": "m"})
            assert status == 429
            assert headers["x-kvgate-reject-reason"] == "tenant-concurrency"
            engine.release.set()
            rest = await resp.read()
            assert json.loads(first + rest)["usage"] == FORWARD_USAGE
            resp.release()
            await until(lambda: gw.tenant_state("alice")["in_use"] == 0)
            # an SSE answer is read for its usage like any stream (7 + 2)
            before = gw.tenant_state("alice")["available_tokens"]
            status, _, raw = await _raw(s, "POST", gw.url + "/v1/events", {"stream": True})
            assert status == 200
            assert raw.endswith(b"data: [DONE]\n\n")
            assert 0 < before - gw.tenant_state("alice")["available_tokens"] <= 9
            # a model no backend serves: 404, nothing forwarded
            count = len(engine.seen)
            status, _, raw = await _raw(s, "POST", gw.url + "/v1/rerank", {"model": "other"})
            assert status == 404
            assert json.loads(raw)["error"]["code"] == "model_not_found"
            assert len(engine.seen) == count
            gw.gateway.metrics.flush()
            text = await get_text(gw.url + "/metrics")
            assert metric(text, "kvgate_requests_total", tenant="alice", outcome="ok") == 3
            assert metric(text, "kvgate_rejections_total", reason="tenant-concurrency") == 1
            assert gw.backend_state()["in_use"] == 0
            assert gw.backend_state()["inflight_tokens"] == 0


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: str) -> bytes:
    """Send one request head on a kept-alive connection and read up to the end of the answer's
    head (any bytes after it stay in ``reader``, where the next answer is read from)."""
    writer.write(head.encode())
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)


async def test_forward_bodiless_answers_and_non_path_targets(gateway_for) -> None:
    """Under ``other_routes: forward``, the answer to ``HEAD`` and a ``204`` end at their head
    (no chunked framing, whose last chunk the client would read as the start of the next
    answer), so the next answer on the same kept-alive connection starts where it should; and
    ``OPTIONS *`` / ``CONNECT host:port``, which name no path on an engine, are 404
    ``unknown_url`` (never a 502), nothing sent upstream, nothing held."""
    async with run_routes_engine() as engine:
        cfg = _forwarding(_with_tenant(config_for(engine.url, ["m"])))
        async with gateway_for(cfg) as gw:
            host, port = gw.url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            auth = f"Host: x\r\nAuthorization: Bearer {KEY}\r\n"
            try:
                head = await _exchange(reader, writer, f"HEAD /v1/files HTTP/1.1\r\n{auth}\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                head = await _exchange(
                    reader, writer, f"DELETE /v1/nocontent HTTP/1.1\r\n{auth}\r\n"
                )
                assert head.startswith(b"HTTP/1.1 204 "), head
                assert b"transfer-encoding" not in head.lower()
                # a 304 to a conditional GET is relayed (not taken for a redirect)
                head = await _exchange(
                    reader,
                    writer,
                    f'GET /v1/unchanged HTTP/1.1\r\n{auth}If-None-Match: "v1"\r\n\r\n',
                )
                assert head.startswith(b"HTTP/1.1 304 "), head
                assert b"transfer-encoding" not in head.lower()
                head = await _exchange(
                    reader, writer, f"GET /v1/files HTTP/1.1\r\n{auth}Connection: close\r\n\r\n"
                )
                assert head.startswith(b"HTTP/1.1 200 "), head
                rest = await asyncio.wait_for(reader.read(), 30)
                assert b'"path":"/v1/files"' in rest
            finally:
                writer.close()
            assert [m for m, _, _ in engine.seen] == ["HEAD", "DELETE", "GET", "GET"]
            for target in ("OPTIONS *", f"CONNECT {host}:{port}"):
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    head = await _exchange(
                        reader, writer, f"{target} HTTP/1.1\r\n{auth}Connection: close\r\n\r\n"
                    )
                    assert head.startswith(b"HTTP/1.1 404 "), (target, head)
                    err = json.loads(await asyncio.wait_for(reader.read(), 30))["error"]
                    assert err["code"] == "unknown_url"
                    assert target in err["message"]
                finally:
                    writer.close()
            assert len(engine.seen) == 4
            await until(lambda: gw.backend_state()["in_use"] == 0)
            assert gw.backend_state()["inflight_tokens"] == 0
            assert gw.tenant_state("alice")["in_use"] == 0


async def test_forward_respects_the_tenants_backends(gateway_for) -> None:
    """A forwarded request without a model goes to a backend the tenant may use, never
    another."""
    async with run_routes_engine() as first, run_routes_engine() as second:
        data = config_for(first.url, ["m"]).model_dump()
        other = {**data["backends"][0], "name": "b1", "url": second.url}
        data["backends"].append(other)
        data["tenants"] = [{"name": "alice", "api_key_sha256": [sha(KEY)], "backends": ["b1"]}]
        data["other_routes"] = "forward"
        async with gateway_for(Config.model_validate(data)) as gw, aiohttp.ClientSession() as s:
            for _ in range(4):
                status, _, _ = await _raw(s, "POST", gw.url + "/v1/score", None)
                assert status == 200
            assert first.seen == []
            assert len(second.seen) == 4


async def test_responses_default_limit_is_injected_as_max_output_tokens(gateway_for) -> None:
    """A Responses request without ``max_output_tokens`` reserves the model's
    ``default_max_tokens``, which the engine then receives as ``max_output_tokens``."""
    async with run_routes_engine() as engine:
        data = _with_tenant(config_for(engine.url, ["pause"], context_window=4096)).model_dump()
        data["backends"][0]["models"][0]["default_max_tokens"] = 64
        cfg = Config.model_validate(data)
        engine.release.set()  # the request goes upstream as a stream: let it end
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            answer = await client.responses.create(model="pause", input="hi")
            assert answer.output_text == "abc"
            sent = json.loads(engine.seen[-1][2])
            assert sent["stream"] is True
            assert sent["max_output_tokens"] == 64
            assert "max_tokens" not in sent
            assert sent["input"] == "hi"


@pytest.mark.parametrize(
    ("method", "path", "kind", "canonical"),
    [
        ("POST", "/v1/chat/completions", RouteKind.INFERENCE, "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/", RouteKind.INFERENCE, "/v1/chat/completions"),
        ("POST", "//v1//chat//completions//", RouteKind.INFERENCE, "/v1/chat/completions"),
        ("POST", "/v1/responses", RouteKind.INFERENCE, "/v1/responses"),
        ("GET", "/v1/responses/", RouteKind.WRONG_METHOD, "/v1/responses"),
        ("GET", "//v1/models/", RouteKind.GATEWAY, "/v1/models"),
        ("HEAD", "/metrics", RouteKind.GATEWAY, "/metrics"),
        ("POST", "/metrics/", RouteKind.WRONG_METHOD, "/metrics"),
        ("GET", "/v1/models/org/m-1", RouteKind.MODEL, "/v1/models/org/m-1"),
        ("POST", "/v1/rerank/", RouteKind.OTHER, "/v1/rerank"),
        ("POST", "/chat/completions", RouteKind.INFERENCE, "/v1/chat/completions"),
        ("GET", "//chat/completions/", RouteKind.WRONG_METHOD, "/v1/chat/completions"),
        # llama.cpp's native completion and embeddings (not OpenAI's): other routes
        ("POST", "/completions", RouteKind.OTHER, "/completions"),
        ("POST", "/embeddings", RouteKind.OTHER, "/embeddings"),
        ("POST", "/completion", RouteKind.OTHER, "/completion"),
        ("GET", "/", RouteKind.OTHER, "/"),
        ("GET", "///", RouteKind.OTHER, "/"),
        ("POST", "/v1/../metrics", RouteKind.BAD_PATH, "/v1/../metrics"),
    ],
)
def test_route_table(method: str, path: str, kind: RouteKind, canonical: str) -> None:
    """The route is decided on the normalised path."""
    route = route_of(method, path)
    assert (route.kind, route.path) == (kind, canonical)
    assert normalize_path(canonical) == canonical


async def test_forward_refuses_engine_administration_and_native_generation(gateway_for) -> None:
    """With ``other_routes: forward``, an engine's own administration routes and its native
    generation routes are refused (403 ``route_not_forwarded``) and never reach the engine: any
    tenant could erase llama.cpp's slots, read other tenants' prompts in ``/slots``, load LoRA
    adapters, or generate through ``/completion`` (or ``/v1/messages``, or TGI's ``POST /``)
    without its tokens being charged. Reading ``/props`` and ``/`` is forwarded."""
    async with run_routes_engine() as engine:
        cfg = _forwarding(_with_tenant(config_for(engine.url, ["m"])))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            gen = {"prompt": "hello", "n_predict": 400}
            for method, path, body in (
                ("POST", "/completion", gen),
                ("POST", "//completion/", gen),
                ("POST", "/infill", gen),
                ("POST", "/generate", {"inputs": "hi"}),
                ("POST", "/invocations", {"model": "m", "prompt": "hi"}),
                ("GET", "/slots", None),
                ("POST", "/slots/0?action=erase", None),
                ("POST", "/slots%2F0?action=erase", None),
                ("POST", "/props", {"n_ctx": 1}),
                ("POST", "/lora-adapters", [{"id": 0, "scale": 9}]),
                ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
                ("POST", "/reset_prefix_cache", None),
                ("POST", "/sleep", None),
                ("POST", "/completions", gen),  # llama.cpp's native completion
                ("POST", "/api/chat", {"model": "m", "messages": []}),
                ("POST", "/v1/messages", {"model": "m", "max_tokens": 10**8, "messages": []}),
                ("POST", "/", {"inputs": "hi"}),  # TGI's generation
                ("POST", "/pause", None),
                ("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
            ):
                status, _, raw = await _raw(s, method, gw.url + path, body)
                assert status == 403, (method, path, raw)
                assert json.loads(raw)["error"]["code"] == "route_not_forwarded", path
            assert engine.seen == []
            status, _, _ = await _raw(s, "GET", gw.url + "/props")
            assert status == 200
            assert engine.seen[-1][:2] == ("GET", "/props")
            status, _, _ = await _raw(s, "GET", gw.url + "/")
            assert status == 200
            assert engine.seen[-1][:2] == ("GET", "/")
            assert gw.tenant_state("alice")["in_use"] == 0
            assert gw.backend_state()["in_use"] == 0


async def test_a_client_without_a_key_learns_nothing_of_the_engines_routes(gateway_for) -> None:
    """A request without a valid key to a route that is not forwarded gets 401
    ``invalid_api_key``, as on a route that is: which routes the engine has, and which the
    gateway refuses, is not told to a client the gateway does not know."""
    async with run_routes_engine() as engine:
        cfg = _forwarding(_with_tenant(config_for(engine.url, ["m"])))
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            for path in ("/slots", "/props", "/no-such-route"):
                for headers in ({}, {"Authorization": "Bearer nope"}):
                    async with s.get(gw.url + path, headers=headers) as r:
                        assert r.status == 401, (path, headers)
                        assert (await r.json())["error"]["code"] == "invalid_api_key"
            assert engine.seen == []
            status, _, raw = await _raw(s, "GET", gw.url + "/slots")  # with the key: 403
            assert (status, json.loads(raw)["error"]["code"]) == (403, "route_not_forwarded")


def test_other_routes_is_validated(tmp_path) -> None:
    """``other_routes`` takes ``refuse`` (the default) or ``forward``; anything else is a
    configuration error naming the field."""
    base = (
        "backends:\n  - name: b0\n    url: http://127.0.0.1:9\n    max_concurrency: 1\n"
        "    models: [{name: m, context_window: 64}]\n"
    )
    path = tmp_path / "kvgate.yaml"
    path.write_text(base)
    assert load_config(path).other_routes == "refuse"
    path.write_text(base + "other_routes: forward\n")
    assert load_config(path).other_routes == "forward"
    path.write_text(base + "other_routes: maybe\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "other_routes" in str(err.value)


async def test_responses_incomplete_stream_is_reconciled_from_its_usage(gateway_for) -> None:
    """A Responses stream cut at ``max_output_tokens`` ends with ``response.incomplete``, whose
    usage settles the reservation like ``response.completed``'s (the simulator behind the
    gateway, generating exactly ``max_output_tokens`` with ``ignore_eos``)."""
    async with run_sim(SimConfig.from_profile("tiny", speed=50)) as sim:
        model = sim.engine.config.model
        cfg = _with_tenant(config_for(sim.url, [model], context_window=1024))
        async with gateway_for(cfg) as gw, _client(gw.url) as client:
            stream = await client.responses.create(
                model=model,
                input="hello",
                max_output_tokens=5,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            events = [event async for event in stream]
            last = events[-1]
            assert last.type == "response.incomplete"
            usage = last.response.usage
            assert usage is not None
            assert usage.output_tokens == 5
            deltas = [e for e in events if e.type == "response.output_text.delta"]
            assert len(deltas) == 5
            await until(lambda: gw.backend_state()["in_use"] == 0)
            spent = 100_000 - gw.tenant_state("alice")["available_tokens"]
            assert usage.total_tokens - 30 <= spent <= usage.total_tokens, spent
